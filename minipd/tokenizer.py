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

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        """The prompt text for a conversation, through the tokenizer's chat template (or ``chat_template``).

        ``messages`` is a list of ``{"role": ..., "content": ...}`` with string values, as OpenAI's and
        vLLM's chat APIs take them; with ``add_generation_prompt`` the text ends where the reply begins.
        """
        from minipd.errors import ParameterError

        if not isinstance(messages, list) or not messages:
            raise ParameterError("messages", "messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ParameterError(f"messages[{i}]", f"messages[{i}] must be a dict with string 'role' and "
                                                       f"'content', got {message!r:.200}")
        template = chat_template or getattr(self.hf, "chat_template", None)
        if not template:
            raise ParameterError("messages", "this model's tokenizer has no chat template: pass chat_template= "
                                             "or send a plain prompt")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=template)

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

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int, last: bool = False) -> str:
        """Append one token; return the text it completed.

        While a character is unfinished the delta is "" and the bytes wait for the next token;
        with ``last`` they are flushed as they are, so the deltas add up to ``decode(token_ids)``.
        """
        self.token_ids.append(token_id)
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip)
        after = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip)
        if len(after) > len(before) and (last or not after.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return after[len(before):]
        return ""
