"""Checking what callers pass to ``LLM.generate`` before any work starts.

Every problem is a ``ValueError`` that names the field and what is allowed, raised before any
request runs, so a bad call leaves the engine as it was.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

from minipd.errors import ParameterError
from minipd.sampling_params import SamplingParams, check_seed, is_integer

if TYPE_CHECKING:
    from minipd.tokenizer import Tokenizer

PromptInput = str | Sequence[int]


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One string, one list of token ids, or a list of either, as a list of prompts.

    Token ids may be Python or NumPy integers (returned as plain ints); bools are refused, and so
    are ``bytes``, which Python would otherwise read as a list of small integers.
    """
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ParameterError("prompts", "prompts must be a string, a list of token ids, or a list of those; "
                                        f"got {_kind(prompts)}")
    if len(prompts) == 0:
        raise ParameterError("prompts", "prompts must not be empty: pass at least one prompt")
    if all(isinstance(p, numbers.Integral) for p in prompts):
        return [_token_ids(0, prompts)]  # a single prompt given as token ids
    out: list[PromptInput] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (bytes, bytearray)) or not isinstance(p, Sequence):
            raise ParameterError(f"prompts[{i}]",
                                 f"prompts[{i}] must be a string or a list of token ids, got {_kind(p)}")
        else:
            out.append(_token_ids(i, p))
    return out


def _token_ids(index: int, ids: Sequence) -> list[int]:
    """``ids`` as plain ints; a bool or non-integer is a ``ValueError`` naming ``prompts[index]``."""
    bad = next((t for t in ids if not is_integer(t)), None)
    if bad is not None:
        raise ParameterError(f"prompts[{index}]",
                             f"prompts[{index}] has token id {bad!r} ({type(bad).__name__}); "
                             "token ids must be integers")
    return [int(t) for t in ids]


def _kind(value: object) -> str:
    """The type of a rejected prompt, with a hint for bytes (the usual slip is forgetting ``.decode()``)."""
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__} (decode it to a str, or pass a list of token ids)"
    return type(value).__name__


def normalize_params(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` for all prompts, or one per prompt (None means the defaults)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise ParameterError("sampling_params",
                             "sampling_params must be None, a SamplingParams, or a list of them (one per prompt); "
                             f"got {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise ParameterError("sampling_params",
                             f"sampling_params has {len(params)} entries but there are {count} prompts; "
                             "pass one SamplingParams or one per prompt")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ParameterError(f"sampling_params[{i}]",
                                 f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def check_prompt_ids(index: int, token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt must be non-empty, use only ids in the vocabulary, and leave room for one new token."""
    if len(token_ids) == 0:
        raise ParameterError(f"prompts[{index}]", f"prompts[{index}] is empty: a prompt needs at least one token")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParameterError(f"prompts[{index}]",
                             f"prompts[{index}] has token id {bad}, outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ParameterError(f"prompts[{index}]",
                             f"prompts[{index}] has {len(token_ids)} tokens; the model's context is "
                             f"{max_model_len}, so prompts may have at most {max_model_len - 1}")


def check_llm_args(max_model_len: object, seed: object) -> tuple[int | None, int | None]:
    """``LLM(max_model_len=..., seed=...)`` checked before the model loads, returned as plain ints.

    ``max_model_len`` must be None or an integer >= 2 (a prompt token and one new token); whether it
    fits the model's context is checked once the model's config is read. ``seed`` must be None or a
    64-bit integer, as :class:`SamplingParams` requires. Bools are refused for both.
    """
    if max_model_len is not None:
        if not is_integer(max_model_len) or max_model_len < 2:
            raise ParameterError("max_model_len",
                                 f"max_model_len must be None or an integer >= 2, got {max_model_len!r}")
        max_model_len = int(max_model_len)
    return max_model_len, check_seed("seed", seed)


def encode_prompt(tokenizer: Tokenizer, prompt: PromptInput, index: int, vocab_size: int,
                  max_model_len: int) -> tuple[list[int], str | None]:
    """``prompt`` as checked token ids, and its text when it was given as text; ``index`` names it in errors."""
    if isinstance(prompt, str):
        if not prompt:
            raise ParameterError(f"prompts[{index}]",
                                 f"prompts[{index}] is an empty string: a prompt needs at least one token")
        ids, text = tokenizer.encode(prompt), prompt
    else:
        ids, text = list(prompt), None
    check_prompt_ids(index, ids, vocab_size, max_model_len)
    return ids, text
