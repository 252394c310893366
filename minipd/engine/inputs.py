"""Checking what callers pass to ``LLM.generate`` before any work starts.

Every problem is a ``ValueError`` that names the field and what is allowed, raised before any
request runs, so a bad call leaves the engine as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

from minipd.sampling_params import SamplingParams

PromptInput = str | Sequence[int]


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One string, one list of token ids, or a list of either, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty: pass at least one prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # a single prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not (isinstance(p, Sequence) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
    return list(prompts)


def normalize_params(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` for all prompts, or one per prompt (None means the defaults)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries but there are {count} prompts; "
                         "pass one SamplingParams or one per prompt")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def check_prompt_ids(index: int, token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt must be non-empty, use only ids in the vocabulary, and leave room for one new token."""
    if len(token_ids) == 0:
        raise ValueError(f"prompts[{index}] is empty: a prompt needs at least one token")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompts[{index}] has token id {bad}, outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompts[{index}] has {len(token_ids)} tokens; the model's context is "
                         f"{max_model_len}, so prompts may have at most {max_model_len - 1}")
