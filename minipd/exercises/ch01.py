"""Chapter 01 exercises: the pieces of a decoder-only transformer, sampling, and the decode loop.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck
reader can read it) and a checker (``check_<name>(fn)``) that runs the reader's function on seeded
inputs, including edge cases, and prints PASS, FAIL or TODO. The checkers compare against the
engine's own code in :mod:`minipd.layers` where it exists, so a PASS means "behaves like minipd".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from minipd.config import ModelConfig, RopeConfig
from minipd.exercises.checking import (
    Case,
    CheckResult,
    call_reader,
    check_tensor_fn,
    describe_exception,
    report,
)
from minipd.kv.contiguous import ContiguousKVCache
from minipd.layers.attention import attention as _attention
from minipd.layers.attention import causal_mask as _causal_mask
from minipd.layers.norm import rms_norm as _rms_norm
from minipd.layers.rotary import RotaryEmbedding
from minipd.layers.rotary import apply_rotary as _apply_rotary
from minipd.layers.sampler import top_k_top_p_filter as _top_k_top_p_filter
from minipd.models.decoder import DecoderModel

__all__ = [
    "check_apply_rope",
    "check_causal_mask",
    "check_greedy_generate",
    "check_grouped_query_attention",
    "check_rms_norm",
    "check_top_p_filter",
    "reference_apply_rope",
    "reference_causal_mask",
    "reference_greedy_generate",
    "reference_grouped_query_attention",
    "reference_rms_norm",
    "reference_top_p_filter",
]


# --- reference solutions ------------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, statistics in fp32."""
    x32 = x.float()  # bf16 has too few mantissa bits for a sum of squares
    rms = torch.sqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 / rms).to(x.dtype)


def reference_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (tokens, heads, head_dim) by the angles in ``cos``/``sin`` (tokens, 1, head_dim).

    HF layout: channel ``i`` pairs with channel ``i + head_dim/2``, and the pair ``(a, b)`` turns
    into ``(a cos - b sin, b cos + a sin)``.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    rotated_90 = torch.cat((-b, a), dim=-1)
    return x * cos + rotated_90 * sin


def reference_causal_mask(num_queries: int, num_keys: int) -> torch.Tensor:
    """Boolean (num_queries, num_keys), True where query ``i`` may attend to key ``j``.

    The queries are the *last* ``num_queries`` positions, so query ``i`` sits at position
    ``num_keys - num_queries + i`` and sees keys ``0 ..`` that position.
    """
    q_pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
    k_pos = torch.arange(num_keys)[None, :]
    return k_pos <= q_pos


def reference_grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q`` (T, Hq, D) over ``k``, ``v`` (S, Hkv, D); returns (T, Hq, D).

    Query head ``h`` uses key/value head ``h // (Hq // Hkv)``, and the T queries are the last T of
    the S positions. Scores are scaled by ``1 / sqrt(D)``.
    """
    num_queries, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    # Neighbouring query heads share a KV head, so repeat each KV head `group` times in place.
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * head_dim**-0.5
    scores = scores.masked_fill(~reference_causal_mask(num_queries, num_keys).to(q.device), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v)


def reference_top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set every logit outside the top-p nucleus to -inf; logits (..., vocab).

    The nucleus is the smallest set of most likely tokens whose probabilities sum to at least
    ``top_p``: a token stays if the tokens ranked above it hold less than ``top_p`` in total, so
    the most likely token always stays.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    # Put each kept logit back at its token's place in the vocabulary.
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@torch.inference_mode()
def reference_greedy_generate(model: DecoderModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The ``max_new_tokens`` tokens greedy decoding adds after ``prompt_ids`` (prompt not included).

    One prefill pass over the prompt fills a :class:`~minipd.kv.ContiguousKVCache`; each decode
    pass then feeds only the newest token, at the next position, and reads the rest from the cache.
    """
    cfg = model.config
    weight = model.embed_tokens.weight
    cache = ContiguousKVCache(cfg.num_hidden_layers, len(prompt_ids) + max_new_tokens, cfg.num_key_value_heads,
                              cfg.head_dim, dtype=weight.dtype, device=weight.device)
    tokens = torch.tensor(list(prompt_ids), device=weight.device)
    positions = torch.arange(len(tokens), device=weight.device)
    new_tokens: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model(tokens, positions, cache)  # prefill on the first pass, decode after
        next_id = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        new_tokens.append(next_id)
        tokens = torch.tensor([next_id], device=weight.device)
        positions = torch.tensor([cache.length], device=weight.device)  # the next free position
    return new_tokens


# --- inputs, including edge cases ---------------------------------------------------------------


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _rms_norm_cases(g: torch.Generator) -> list[Case]:
    zero_row = _randn(g, 3, 16)
    zero_row[1] = 0.0
    return [
        Case("fp32 (4, 64), unit weight", (_randn(g, 4, 64), torch.ones(64), 1e-5)),
        Case("fp32 (2, 3, 32), learned weight", (_randn(g, 2, 3, 32, scale=3.0), _randn(g, 32), 1e-6)),
        Case("one vector (48,)", (_randn(g, 48), _randn(g, 48), 1e-5)),
        Case("a row of zeros: eps keeps it finite", (zero_row, _randn(g, 16), 1e-5)),
        Case("tiny activations, where eps matters", (_randn(g, 2, 32, scale=1e-3), torch.ones(32), 1e-5)),
        # bf16 keeps 8 bits of mantissa, so allow bf16-sized rounding differences here.
        Case("bf16 input and weight", (_randn(g, 3, 64).bfloat16(), _randn(g, 64).bfloat16(), 1e-5),
             atol=2e-2, rtol=2e-2),
    ]


def _rope_case(g: torch.Generator, label: str, positions: torch.Tensor, heads: int, head_dim: int) -> Case:
    rotary = RotaryEmbedding(head_dim, int(positions.max()) + 1, RopeConfig(theta=10000.0))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    return Case(label, (_randn(g, len(positions), heads, head_dim), cos, sin))


def _rope_cases(g: torch.Generator) -> list[Case]:
    return [
        _rope_case(g, "8 tokens at positions 0..7, 4 heads of 16", torch.arange(8), 4, 16),
        _rope_case(g, "a later chunk at positions 500..505, 2 heads of 64", torch.arange(500, 506), 2, 64),
        _rope_case(g, "one decode token at position 37, 8 heads of 32", torch.tensor([37]), 8, 32),
    ]


def _mask_cases(g: torch.Generator) -> list[Case]:
    return [
        Case("prefill: 6 queries over 6 keys", (6, 6)),
        Case("decode: 1 query over 9 keys", (1, 9)),
        Case("a chunk: 3 new queries after 7 cached keys", (3, 10)),
        Case("a single token", (1, 1)),
    ]


def _attention_cases(g: torch.Generator) -> list[Case]:
    def qkv(t: int, s: int, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
        return _randn(g, t, hq, d), _randn(g, s, hkv, d), _randn(g, s, hkv, d)

    return [
        Case("prefill: 6 queries over 6 keys, 8 query heads sharing 2 KV heads", qkv(6, 6, 8, 2, 16)),
        Case("decode: 1 query over 9 keys, 8 query heads sharing 2 KV heads", qkv(1, 9, 8, 2, 16)),
        Case("a chunk: 4 queries over 11 keys, 4 query heads sharing 2 KV heads", qkv(4, 11, 4, 2, 32)),
        Case("plain multi-head: 4 query heads, 4 KV heads", qkv(5, 5, 4, 4, 8)),
        Case("multi-query: 6 query heads sharing 1 KV head", qkv(3, 7, 6, 1, 8)),
    ]


def _top_p_cases(g: torch.Generator) -> list[Case]:
    peaked = _randn(g, 40)
    peaked[7] = 12.0  # this one token holds almost all the probability
    return [
        Case("(4, 50) logits, top_p=0.9", (_randn(g, 4, 50, scale=2.0), 0.9)),
        Case("(3, 50) logits, top_p=0.5", (_randn(g, 3, 50, scale=2.0), 0.5)),
        Case("one (40,) row whose top token alone exceeds top_p=0.8", (peaked, 0.8)),
        Case("top_p=1e-4: only the most likely token stays", (_randn(g, 2, 30, scale=2.0), 1e-4)),
    ]


def _minipd_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The engine's filter with top-k switched off, for (..., vocab) logits."""
    rows = logits.reshape(-1, logits.shape[-1])
    n = rows.shape[0]
    return _top_k_top_p_filter(rows, torch.full((n,), -1), torch.full((n,), float(top_p))).reshape(logits.shape)


def _minipd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _attention(q, k, v, scale=q.shape[-1] ** -0.5)


# --- checkers -----------------------------------------------------------------------------------


def check_rms_norm(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> CheckResult:
    """Check ``fn(x, weight, eps)`` against :func:`minipd.layers.rms_norm`."""
    return report(check_tensor_fn("rms_norm", fn, _rms_norm, _rms_norm_cases, atol=1e-5, rtol=1e-5))


def check_apply_rope(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> CheckResult:
    """Check ``fn(x, cos, sin)`` against :func:`minipd.layers.apply_rotary` (HF rotate-half layout)."""
    return report(check_tensor_fn("apply_rope", fn, _apply_rotary, _rope_cases, atol=1e-5, rtol=1e-5))


def check_causal_mask(fn: Callable[[int, int], torch.Tensor]) -> CheckResult:
    """Check ``fn(num_queries, num_keys)`` against :func:`minipd.layers.attention.causal_mask`."""
    return report(check_tensor_fn("causal_mask", fn, _causal_mask, _mask_cases))


def check_grouped_query_attention(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                                  ) -> CheckResult:
    """Check ``fn(q, k, v)`` against :func:`minipd.layers.attention` with scale ``1/sqrt(head_dim)``."""
    return report(check_tensor_fn("grouped_query_attention", fn, _minipd_attention, _attention_cases,
                                  atol=1e-5, rtol=1e-4))


def check_top_p_filter(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> CheckResult:
    """Check ``fn(logits, top_p)`` against the nucleus filter of :mod:`minipd.layers.sampler`."""
    return report(check_tensor_fn("top_p_filter", fn, _minipd_top_p, _top_p_cases))


def make_check_model(seed: int = 0) -> DecoderModel:
    """A small random Llama-style :class:`DecoderModel` for checking decode loops, the same for a seed.

    Weights are drawn from a private generator (the global RNG is left alone) with a large enough
    spread that the logits are peaked, so greedy choices are never near-ties.
    """
    config = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rms_norm_eps=1e-5, sliding_windows=(None, None))
    # Built on the meta device so nn.Linear's own initialisation never draws from the global RNG.
    with torch.device("meta"):
        model = DecoderModel(config)
    model = model.to_empty(device="cpu")
    model.rotary.reset_cache("cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:  # weight matrices
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
            else:  # norm weights start at one, as in a freshly initialised model
                param.fill_(1.0)
    return model.eval().requires_grad_(False)


#: (label, prompt, max_new_tokens) for the greedy-decoding checker.
_GREEDY_CASES = [
    ("a 5-token prompt, 12 new tokens", [3, 17, 42, 5, 8], 12),
    ("a 1-token prompt, 6 new tokens", [7], 6),
    ("one new token only (prefill, no decode step)", [11, 12, 13], 1),
]


def check_greedy_generate(fn: Callable[[DecoderModel, list[int], int], Any]) -> CheckResult:
    """Check ``fn(model, prompt_ids, max_new_tokens)`` token for token against a KV-cached greedy loop.

    Runs on a small random model. ``fn`` returns the new tokens only (a list of ints or a 1-D
    tensor). Matching tokens are not enough: the model must also see each token only once (the
    prompt in prefill, then one token per decode step), which is what the KV cache buys.
    """
    name = "greedy_generate"
    model = make_check_model()
    seen = [0]

    def count_tokens(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(input_ids, torch.Tensor):
            seen[0] += input_ids.numel()

    for label, prompt, max_new in _GREEDY_CASES:
        expected = reference_greedy_generate(model, prompt, max_new)
        seen[0] = 0
        handle = model.register_forward_pre_hook(count_tokens, with_kwargs=True)
        try:
            with torch.inference_mode():
                actual, failure = call_reader(name, fn, Case(label, (model, list(prompt), max_new)))
        finally:
            handle.remove()
        if failure is not None:
            return report(failure)
        where = f"[case: {label}]"
        try:
            tokens = _as_token_list(actual)
        except (TypeError, ValueError) as err:
            return report(CheckResult("FAIL", name, f"{describe_exception(err)} {where}"))
        if tokens != expected[: len(tokens)] or len(tokens) != len(expected):
            return report(_token_mismatch(name, tokens, expected, len(prompt), where))
        needed = len(prompt) + max_new - 1
        if seen[0] > needed:
            return report(CheckResult(
                "FAIL", name, f"right tokens, but the model processed {seen[0]} tokens where a KV cache needs "
                              f"{needed} (the prompt once, then one token per decode step) {where}"))
    return report(CheckResult("PASS", name))


def _as_token_list(value: Any) -> list[int]:
    """A list of ints from a list/tuple of ints or a 1-D integer tensor; raises with a clear message."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            raise TypeError(f"returned a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
                            "expected a 1-D tensor of token ids or a list of ints")
        return [int(t) for t in value.tolist()]
    if isinstance(value, (list, tuple)):
        if not all(isinstance(t, int) or (isinstance(t, torch.Tensor) and t.numel() == 1) for t in value):
            raise TypeError("returned a list whose items are not all token ids (ints)")
        return [int(t) for t in value]
    raise TypeError(f"returned {type(value).__name__}, expected a list of token ids")


def _token_mismatch(name: str, tokens: list[int], expected: list[int], prompt_len: int, where: str) -> CheckResult:
    if len(tokens) == len(expected) + prompt_len and tokens[prompt_len:] == expected:
        return CheckResult("FAIL", name, f"returned the prompt too: {len(tokens)} tokens where {len(expected)} "
                                         f"are new (return only the new tokens) {where}", first_mismatch=0)
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)
    if first is not None:
        message = f"new token {first} differs: got {tokens[first]}, expected {expected[first]} {where}"
    else:
        first = min(len(tokens), len(expected))
        message = f"returned {len(tokens)} tokens, expected {len(expected)} {where}"
    return CheckResult("FAIL", name, message, first_mismatch=first)
