"""Text <-> token ids through ``transformers.AutoTokenizer``, plus incremental detokenization.

transformers is imported only when a tokenizer is loaded, so ``import minipd`` stays fast.
"""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """The model folder's HF tokenizer with the few calls the engine needs."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``, with the special tokens (e.g. BOS) the model expects."""
        # verbose=False: minipd checks prompt lengths itself, with a clearer error than HF's warning.
        return list(self.hf(text, verbose=False)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for ``token_ids``; end-of-sequence and other special tokens are left out by default."""
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id, if it has one."""
        return self.hf.eos_token_id


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything each time.

    Byte-level tokens can end in the middle of a UTF-8 character, and some tokenizers change how a
    token renders depending on the one before; so each step decodes a short window that starts a
    few tokens back and emits only what is new and complete.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int, last: bool = False) -> str:
        """Append one token; return the text it completed.

        While a character is unfinished the delta is "" and the bytes wait for the next token;
        with ``last`` they are flushed as they are, so the deltas add up to ``decode(token_ids)``.
        """
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = decode(self.token_ids[self.prefix_offset:])
        if len(after) > len(before) and (last or not after.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return after[len(before):]
        return ""
