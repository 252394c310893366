"""Chapter 01 exercises: pieces of a decoder-only transformer, plugged into minipd and checked end to end.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck reader
can read it) and a checker (``check_<name>(fn)``) that prints PASS, FAIL or TODO. A checker first
runs the reader's piece on a few fixed inputs, edge cases included (quick, and precise about where
an answer departs), then **plugs it into minipd** and runs the bundled ``tiny-py`` model on a few
prompts: the logits and the generated tokens must be the engine's own.

- ``check_apply_rope_interleaved``: the reader's rotation for the *interleaved* RoPE layout (pairs of
  adjacent channels) replaces the one every attention layer calls, in a copy of ``tiny-py`` whose
  q/k projections are stored in that layout (as Meta's original Llama checkpoints were).
- ``check_sliding_window_mask``: the reader's mask is the one attention uses, in ``tiny-py`` with a
  sliding window on every layer (as Mistral's layers have), in prefill and in decode.
- ``check_top_p_filter``: the reader's nucleus filter is the one the engine's sampler applies, for
  seeded sampling at temperature 0.8 and top-p 0.8: the same seeds must draw the same tokens.
- ``check_kv_cache``: the reader's KV cache class holds the K/V of a greedy loop over ``tiny-py``
  (prefill whole or in chunks, then decode); its tokens must be those of ``LLM.generate``.

Plugging in swaps an attribute (the engine's kernel backend, whose ``rotary`` every attention layer calls;
``minipd.kernels.attention.causal_mask``; ``minipd.layers.sampler.top_k_top_p_filter``) inside a
context manager that always puts it back, even when the reader's code raises; every checker builds
its own ``LLM``, so the reader's ``llm`` is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

import minipd.layers.sampler as sampler_module
from minipd.config import RopeConfig
from minipd.exercises.checking import (
    Case,
    CheckResult,
    check_tensor_fn,
    describe_exception,
    report,
    tensor_mismatch,
    todo,
)
from minipd.kernels.attention import causal_mask as _causal_mask
from minipd.kernels.backend import TORCH_BACKEND, KernelBackend
from minipd.kernels.paged_attention import gather_kv
from minipd.kv.contiguous import ContiguousKVCache
from minipd.layers.attention import attention as _attention
from minipd.layers.rotary import RotaryEmbedding, apply_rotary, deinterleave
from minipd.layers.sampler import top_k_top_p_filter as _top_k_top_p_filter
from minipd.llm import LLM
from minipd.models.decoder import DecoderModel
from minipd.models.forward_context import ForwardContext
from minipd.sampling_params import SamplingParams

# (By module name: ``import minipd.layers.attention as ...`` would give the function the package re-exports.)
attention_module = importlib.import_module("minipd.kernels.attention")

__all__ = [
    "ENGINE_PROMPTS",
    "ENGINE_TOKENS",
    "MODEL",
    "ReaderError",
    "ReferenceKVCache",
    "check_apply_rope_interleaved",
    "check_kv_cache",
    "check_sliding_window_mask",
    "check_top_p_filter",
    "compare_token_runs",
    "engine_failure",
    "engine_llm",
    "greedy_tokens",
    "interleaved_checkpoint",
    "reference_apply_rope_interleaved",
    "reference_kv_cache",
    "reference_sliding_window_mask",
    "reference_top_p_filter",
    "sliding_windows",
    "swapped",
]

#: The bundled model every engine check runs, greedily, on these prompts.
MODEL = "tiny-py"
ENGINE_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
                  "import os\n\n\ndef list_files(path):\n",
                  "class Stack:\n    def __init__(self):\n        self.items = []\n"]
#: New tokens per prompt: enough for a few decode steps past every window, short enough for ~1 s on a CPU.
ENGINE_TOKENS = 16
#: The sliding window of the mask exercise: shorter than every prompt, so it cuts in prefill and decode.
WINDOW = 6


# --- reference solutions ------------------------------------------------------------------------


def reference_apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the interleaved layout: channels ``(2i, 2i + 1)`` form pair ``i``.

    ``x`` is (tokens, heads, head_dim); ``cos`` and ``sin`` are (tokens, 1, head_dim / 2), one angle per
    pair. The pair ``(a, b)`` turns into ``(a cos - b sin, a sin + b cos)``, as in HF's layout; only
    which channels pair up differs.
    """
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def reference_sliding_window_mask(num_queries: int, num_keys: int, window: int) -> torch.Tensor:
    """Boolean (num_queries, num_keys), True where query ``i`` may attend to key ``j``.

    The queries are the last ``num_queries`` of ``num_keys`` positions, so query ``i`` sits at position
    ``q = num_keys - num_queries + i``. It sees key ``j`` when ``j <= q`` (causal) and ``j > q - window``:
    the ``window`` most recent positions, itself included.
    """
    q_pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
    k_pos = torch.arange(num_keys)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


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


class ReferenceKVCache:
    """K/V of one sequence in preallocated per-layer buffers; what the model needs from a cache.

    ``length`` positions are filled. In a forward pass over ``T`` new tokens, every layer calls
    :meth:`attend` with their q, k, v: the k and v go to positions ``length .. length + T - 1`` of that
    layer's buffers, and the queries (the last ``T`` of ``length + T`` positions) attend causally to
    all of them. Only when every layer has done so does the model call :meth:`advance` (``T``): all
    layers write at the same positions in one pass.
    """

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.k = torch.zeros(num_layers, max_len, num_kv_heads, head_dim, dtype=dtype)
        self.v = torch.zeros(num_layers, max_len, num_kv_heads, head_dim, dtype=dtype)
        self.length = 0

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        end = self.length + k.shape[0]
        self.k[layer_idx, self.length:end] = k
        self.v[layer_idx, self.length:end] = v
        # minipd's attention takes the queries to be the last of the keys' positions (GQA included).
        return _attention(q, self.k[layer_idx, :end], self.v[layer_idx, :end], scale, sliding_window)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens


#: The name the checkers look for (``reference_<exercise>``).
reference_kv_cache = ReferenceKVCache


# --- plugging a function into minipd ---------------------------------------------------------------


@contextmanager
def swapped(module: Any, attribute: str, value: Any) -> Iterator[None]:
    """Inside the block ``module.attribute`` is ``value``; afterwards the original, whatever happened."""
    original = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        setattr(module, attribute, original)


def interleaved_order(head_dim: int) -> torch.Tensor:
    """Channel ``c`` of the interleaved layout is channel ``order[c]`` of HF's: 0, d/2, 1, d/2 + 1, ..."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


@contextmanager
def interleaved_checkpoint(model: DecoderModel) -> Iterator[None]:
    """Inside the block ``model``'s q and k projections produce each head's channels in the interleaved
    order; afterwards the original weights, bit for bit, whatever happened.

    HF pairs channel ``i`` with ``i + d/2``; the interleaved layout pairs ``2i`` with ``2i + 1``. Reordering
    the output rows of q and k (the same order for both, so every q·k is unchanged) turns one into the
    other: the converse of what HF's conversion script does to Meta's checkpoints.
    """
    cfg = model.config
    order = interleaved_order(cfg.head_dim)
    saved = []
    try:
        for layer in model.layers:
            attn = layer.self_attn
            weight = attn.qkv_proj.weight
            saved.append(weight.detach().clone())
            heads = cfg.num_attention_heads + cfg.num_key_value_heads
            with torch.no_grad():
                qk = weight[:heads * cfg.head_dim].view(heads, cfg.head_dim, -1)
                qk.copy_(qk[:, order].clone())
            _repack(attn.qkv_proj)
        yield
    finally:
        with torch.no_grad():
            for layer, weight in zip(model.layers, saved, strict=False):
                layer.self_attn.qkv_proj.weight.copy_(weight)
                _repack(layer.self_attn.qkv_proj)


def _repack(linear: Any) -> None:
    """A linear layer that keeps a packed copy of its weight (``PackedLinear`` on the CPU) must rebuild it."""
    repack = getattr(linear, "repack", None)
    if callable(repack):
        repack()


@contextmanager
def sliding_windows(model: DecoderModel, window: int | None) -> Iterator[None]:
    """Inside the block every attention layer of ``model`` has ``window``; afterwards its own."""
    saved = [layer.self_attn.sliding_window for layer in model.layers]
    try:
        for layer in model.layers:
            layer.self_attn.sliding_window = window
        yield
    finally:
        for layer, value in zip(model.layers, saved, strict=True):
            layer.self_attn.sliding_window = value


class ReaderError(Exception):
    """The reader's function, called by the engine, returned something unusable (the message says what)."""


def engine_llm(**options: Any) -> LLM:
    """A fresh fp32 ``tiny-py`` on the CPU (torch kernels, no prefix caching unless asked): the same tokens
    on every machine, and nothing shared with the reader's own ``LLM``."""
    settings: dict[str, Any] = {"enable_prefix_caching": False, "num_kv_blocks": 64, "kernel_backend": "torch"}
    settings.update(options)
    return LLM(MODEL, device="cpu", dtype=torch.float32, **settings)


def greedy_tokens(llm: LLM, prompts: Sequence[Any] = tuple(ENGINE_PROMPTS),
                  max_tokens: int = ENGINE_TOKENS) -> list[list[int]]:
    """The tokens greedy decoding adds to each prompt (end-of-sequence ignored, so always ``max_tokens``)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(list(prompts), params, use_tqdm=False)]


def compare_token_runs(name: str, actual: list[list[int]], expected: list[list[int]], where: str,
                       labels: Sequence[str] | None = None, kind: str = "greedy") -> CheckResult | None:
    """None when every run's tokens are the reference's, else the FAIL naming the first differing token."""
    labels = labels or [repr(p) for p in ENGINE_PROMPTS]
    for label, got, want in zip(labels, actual, expected, strict=True):
        if got != want:
            first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                         min(len(got), len(want)))
            if first < min(len(got), len(want)):
                detail = f"got {got[first]}, expected {want[first]}"
            else:
                detail = f"{len(got)} tokens, expected {len(want)}"
            return CheckResult("FAIL", name, f"{where}: {kind} token {first} for prompt {label} differs: {detail}",
                               first_mismatch=first)
    return None


def engine_failure(name: str, err: Exception, where: str) -> CheckResult:
    """The FAIL for an exception raised while the engine ran the reader's code."""
    if isinstance(err, ReaderError):
        return CheckResult("FAIL", name, f"{where}: {err}")
    return CheckResult("FAIL", name, f"{where}: raised {describe_exception(err)}")


T = TypeVar("T")


def run_plugged(name: str, where: str, plugged: contextlib.AbstractContextManager,
                run: Callable[[], T]) -> tuple[T | None, CheckResult | None]:
    """``run()`` with the reader's code plugged in by ``plugged``: ``(its result, None)``, or ``(None, the
    TODO)`` for an untouched stub, or ``(None, the FAIL)`` when the reader's code broke inside the engine."""
    try:
        with plugged:
            return run(), None
    except NotImplementedError:
        return None, todo(name)
    except Exception as err:  # the reader's function broke inside the engine
        return None, engine_failure(name, err, where)


def _prompt_ids(llm: LLM, prompt: str) -> torch.Tensor:
    return torch.tensor(llm.tokenizer.hf(prompt)["input_ids"])


@torch.inference_mode()
def _prefill_logits(model: DecoderModel, ids: torch.Tensor, kernels: KernelBackend = TORCH_BACKEND) -> torch.Tensor:
    """Logits of every position of ``ids`` in one pass without a cache, on ``kernels``: (tokens, vocab)."""
    return model.compute_logits(model(ids, torch.arange(len(ids)), ForwardContext(None, kernels)))


# --- inputs, including edge cases ---------------------------------------------------------------


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _rope_case(g: torch.Generator, label: str, positions: torch.Tensor, heads: int, head_dim: int) -> Case:
    rotary = RotaryEmbedding(head_dim, int(positions.max()) + 1, RopeConfig(theta=10000.0))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    half = head_dim // 2
    return Case(label, (_randn(g, len(positions), heads, head_dim), cos[..., :half], sin[..., :half]))


def _rope_cases(g: torch.Generator) -> list[Case]:
    return [
        _rope_case(g, "8 tokens at positions 0..7, 4 heads of 16", torch.arange(8), 4, 16),
        _rope_case(g, "a later chunk at positions 500..505, 2 heads of 64", torch.arange(500, 506), 2, 64),
        _rope_case(g, "one decode token at position 37, 8 heads of 32", torch.tensor([37]), 8, 32),
    ]


def _minipd_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """minipd's HF-layout rotation applied to the de-interleaved channels, then interleaved back."""
    rotated = apply_rotary(deinterleave(x), torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    out[..., 0::2], out[..., 1::2] = rotated[..., :half], rotated[..., half:]
    return out


def _mask_cases(g: torch.Generator) -> list[Case]:
    return [
        Case("prefill: 6 queries over 6 keys, window 3", (6, 6, 3)),
        Case("decode: 1 query over 9 keys, window 4", (1, 9, 4)),
        Case("a chunk: 3 new queries after 7 cached keys, window 4", (3, 10, 4)),
        Case("a window longer than the sequence (plain causal)", (5, 5, 10)),
        Case("window 1: each query sees only itself", (4, 12, 1)),
        Case("a single token", (1, 1, 1)),
    ]


def _minipd_window_mask(num_queries: int, num_keys: int, window: int) -> torch.Tensor:
    return _causal_mask(num_queries, num_keys, window)


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


# --- checkers: interleaved RoPE -----------------------------------------------------------------


def _reader_rotary(fn: Callable[..., Any], half: int) -> Callable[..., torch.Tensor]:
    """What the attention layers call in place of ``apply_rotary``: the reader's rotation, given one angle
    per pair (the engine's cos/sin repeat each angle in both halves), its answer checked."""
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = fn(x, cos[..., :half], sin[..., :half])
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
            raise ReaderError(f"your function returned {_describe(out)} for x of shape {tuple(x.shape)} "
                              f"({x.dtype}); expected the same shape and dtype")
        return out
    return rotary


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _check_rope_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    llm = engine_llm()
    model = llm.model
    ids = _prompt_ids(llm, ENGINE_PROMPTS[0])
    expected_logits = _prefill_logits(model, ids)
    expected = greedy_tokens(llm)
    where = (f"plugged into {MODEL} (q/k weights in the interleaved layout, your rotation in every attention "
             "layer)")
    def plugged_in() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(interleaved_checkpoint(model))
        runner = llm.engine.core.runner  # its kernels are every pass's: the rotation here is the reader's
        reader = dataclasses.replace(runner.kernels, rotary=_reader_rotary(fn, model.config.head_dim // 2))
        stack.enter_context(swapped(runner, "kernels", reader))
        return stack

    return _logits_then_tokens(name, where, llm, ids, expected_logits, expected, plugged_in)


def _logits_then_tokens(name: str, where: str, llm: Any, ids: list[int], expected_logits: torch.Tensor,
                        expected: list[list[int]], plugged_in: Callable[[], Any]) -> CheckResult:
    """With the reader's piece plugged in (``plugged_in()``, a context manager): the first prompt's
    logits, then the greedy tokens, against the engine's own; TODO for an untouched stub."""
    try:
        with plugged_in():
            logits = _prefill_logits(llm.model, ids, llm.engine.core.runner.kernels)
            failure, diff = tensor_mismatch(name, logits, expected_logits, 1e-4, 1e-4,
                                            f"[{where}; prompt {ENGINE_PROMPTS[0]!r}, index (position, token)]",
                                            subject="logits:")
            if failure is not None:
                return failure
            actual = greedy_tokens(llm)
    except NotImplementedError:
        return todo(name)
    except Exception as err:  # the reader's function broke inside the model
        return engine_failure(name, err, where)
    return compare_token_runs(name, actual, expected, where) or CheckResult("PASS", name, max_diff=diff)


def check_apply_rope_interleaved(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                                 ) -> CheckResult:
    """Check ``fn(x, cos, sin)`` (interleaved pairs; cos/sin one per pair), then run ``tiny-py`` with it.

    First against minipd's rotation on de-interleaved channels, on three fixed inputs. Then the q/k
    weights of a fresh ``tiny-py`` are reordered into the interleaved layout and ``fn`` replaces the
    rotation every attention layer calls: the prompt's logits (within 1e-4) and a greedy run (three
    prompts, 16 tokens each) must be those of the original model with minipd's own RoPE.
    """
    name = "apply_rope_interleaved"
    result = check_tensor_fn(name, fn, _minipd_rope_interleaved, _rope_cases, atol=1e-5, rtol=1e-5)
    if result.status != "PASS":
        return report(result)
    return report(_check_rope_in_engine(name, fn))


# --- checkers: sliding-window mask --------------------------------------------------------------


def _reader_mask(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """What attention calls in place of ``causal_mask``: the reader's mask (window = all keys when the
    layer has none), its answer checked."""
    def mask(num_queries: int, num_keys: int, sliding_window: int | None = None,
             device: torch.device | None = None) -> torch.Tensor:
        window = num_keys if sliding_window is None else sliding_window
        out = fn(num_queries, num_keys, window)
        if not isinstance(out, torch.Tensor) or out.shape != (num_queries, num_keys) or out.dtype != torch.bool:
            raise ReaderError(f"your mask for ({num_queries}, {num_keys}, window {window}) is {_describe(out)}; "
                              f"expected a torch.bool tensor of shape ({num_queries}, {num_keys})")
        return out.to(device)
    return mask


def _decode_through_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              sliding_window: int | None = None, *,
                              context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """Paged decode that gathers each sequence and calls minipd's ``attention`` (and so its mask)."""
    lengths = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    out = torch.empty_like(q)
    for i, n in enumerate(lengths):
        k, v = gather_kv(k_cache, block_tables[i], n), gather_kv(v_cache, block_tables[i], n)
        out[i] = attention_module.attention(q[i:i + 1], k, v, scale, sliding_window)[0]
    return out


#: The torch kernels, except that decode goes through ``attention`` too: every mask the engine uses is
#: then the one ``minipd.kernels.attention.causal_mask`` names (prefill's already is).
MASKED_BACKEND = dataclasses.replace(TORCH_BACKEND, name="torch-masked",
                                     paged_decode_attention=_decode_through_attention)


def _check_mask_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    llm = engine_llm()
    llm.engine.core.runner.kernels = MASKED_BACKEND
    model = llm.model
    ids = _prompt_ids(llm, ENGINE_PROMPTS[0])
    where = f"plugged into {MODEL} (a {WINDOW}-token sliding window on every layer, your mask in every attention)"
    with sliding_windows(model, WINDOW):
        expected_logits = _prefill_logits(model, ids)
        expected = greedy_tokens(llm)
        return _logits_then_tokens(name, where, llm, ids, expected_logits, expected,
                                   lambda: swapped(attention_module, "causal_mask", _reader_mask(fn)))


def check_sliding_window_mask(fn: Callable[[int, int, int], torch.Tensor]) -> CheckResult:
    """Check ``fn(num_queries, num_keys, window) -> bool (num_queries, num_keys)``, then run ``tiny-py`` with it.

    First against :func:`minipd.kernels.attention.causal_mask` on fixed shapes. Then a fresh ``tiny-py``
    gets a 6-token window on every layer and ``fn`` becomes the mask of every attention it computes
    (prefill and decode): the logits of a 22-token prompt (within 1e-4) and a greedy run (three
    prompts, 16 tokens each) must be the engine's with its own mask.
    """
    name = "sliding_window_mask"
    result = check_tensor_fn(name, fn, _minipd_window_mask, _mask_cases)
    if result.status != "PASS":
        return report(result)
    return report(_check_mask_in_engine(name, fn))


# --- checkers: top-p ----------------------------------------------------------------------------


#: The sampled runs of the top-p check: temperature and nucleus of every request (each with its own seed).
TOP_P_SAMPLING = {"temperature": 0.8, "top_p": 0.8}


def _reader_filter(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """What the sampler calls in place of ``top_k_top_p_filter``: the reader's filter on every row that has a
    nucleus (the check's requests never set top-k), its answer checked."""
    def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        if bool((top_k > 0).any()):
            raise ReaderError("a request with top-k reached the sampler (a bug in the checker)")
        out = logits.clone()
        for i in range(logits.shape[0]):
            if float(top_p[i]) < 1:
                row = fn(logits[i].clone(), float(top_p[i]))
                if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                    raise ReaderError(f"your filter returned {_describe(row)} for a row of {logits.shape[-1]} "
                                      "logits; expected the same shape")
                out[i] = row
        return out
    return top_k_top_p


def _sampled_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(list(ENGINE_PROMPTS), [SamplingParams(max_tokens=ENGINE_TOKENS, seed=seed, ignore_eos=True,
                                                              **TOP_P_SAMPLING) for seed in range(len(ENGINE_PROMPTS))],
                        use_tqdm=False)
    return [list(out.token_ids) for out in outs]


def _check_top_p_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    llm = engine_llm()
    expected = _sampled_tokens(llm)
    where = (f"plugged into {MODEL}'s sampler (temperature {TOP_P_SAMPLING['temperature']}, top_p "
             f"{TOP_P_SAMPLING['top_p']}, seeded; your filter on every sampled row)")
    actual, failure = run_plugged(name, where, swapped(sampler_module, "top_k_top_p_filter", _reader_filter(fn)),
                                  lambda: _sampled_tokens(llm))
    if failure is not None:
        return failure
    return compare_token_runs(name, actual, expected, where, kind="sampled") or CheckResult("PASS", name, max_diff=0.0)


def check_top_p_filter(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> CheckResult:
    """Check ``fn(logits, top_p)`` against the nucleus filter of :mod:`minipd.layers.sampler`, then sample with it.

    First on four fixed cases (the most likely token alone above ``top_p``, a tiny ``top_p``, ...). Then a
    fresh ``tiny-py`` samples three seeded requests (temperature 0.8, top-p 0.8, 16 tokens each) with ``fn``
    as its nucleus filter: with the same seeds, the tokens must be those of the engine's own filter.
    """
    name = "top_p_filter"
    result = check_tensor_fn(name, fn, _minipd_top_p, _top_p_cases)
    if result.status != "PASS":
        return report(result)
    return report(_check_top_p_in_engine(name, fn))


# --- checkers: the KV cache ---------------------------------------------------------------------

#: (label, prompt index, prefill chunk): the whole prompt in one pass, or in chunks of a few tokens.
_CACHE_CASES = [
    ("whole-prompt prefill", 0, None),
    ("whole-prompt prefill", 1, None),
    ("prefill in chunks of 4 tokens", 0, 4),
    ("prefill in chunks of 3 tokens", 2, 3),
]


@torch.inference_mode()
def _greedy_with_cache(model: DecoderModel, ids: torch.Tensor, max_new: int, cache: Any, chunk: int | None
                       ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through ``cache``: the new tokens and the logits each pass's last row gave."""
    done, tokens, logits = 0, [], []
    while done < len(ids):  # prefill, whole or in chunks
        n = len(ids) - done if chunk is None else min(chunk, len(ids) - done)
        row = model.compute_logits(model(ids[done:done + n], torch.arange(done, done + n), cache)[-1:])[0]
        done += n
    for _ in range(max_new):
        logits.append(row)
        tokens.append(int(row.argmax()))
        if len(tokens) == max_new:
            break
        row = model.compute_logits(model(torch.tensor(tokens[-1:]), torch.tensor([done]), cache))[0]
        done += 1
    return tokens, logits


def check_kv_cache(cache_class: Callable[..., Any]) -> CheckResult:
    """Check a KV cache class: ``cache_class(num_layers, max_len, num_kv_heads, head_dim)`` with
    ``attend(layer_idx, q, k, v, scale, sliding_window)`` and ``advance(num_tokens)``.

    A greedy loop over a fresh ``tiny-py`` keeps its K/V in one (a new one per prompt): the prompt in one
    pass or in chunks of a few tokens, then one token per decode step. Each pass's logits must match the
    same loop over minipd's :class:`~minipd.kv.ContiguousKVCache` (within 1e-4), and the 16 new tokens
    must be those ``LLM.generate`` produces.
    """
    name = "kv_cache"
    if not callable(cache_class):
        return report(CheckResult("FAIL", name, f"expected a class, got {type(cache_class).__name__}"))
    llm = engine_llm()
    model, cfg = llm.model, llm.model.config
    prompts = [_prompt_ids(llm, p) for p in ENGINE_PROMPTS]
    engine_tokens = greedy_tokens(llm)
    worst = 0.0
    for label, index, chunk in _CACHE_CASES:
        ids = prompts[index]
        where = f"[case: {label}, prompt {ENGINE_PROMPTS[index]!r}]"
        max_len = len(ids) + ENGINE_TOKENS
        reference = ContiguousKVCache(cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        _, expected_logits = _greedy_with_cache(model, ids, ENGINE_TOKENS, reference, chunk)
        try:
            cache = cache_class(cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
            if not all(callable(getattr(cache, method, None)) for method in ("attend", "advance")):
                return report(CheckResult("FAIL", name, f"cache_class(...) gave a {type(cache).__name__}, which has no "
                                                        "attend and advance methods"))
            tokens, logits = _greedy_with_cache(model, ids, ENGINE_TOKENS, cache, chunk)
        except NotImplementedError:
            return report(todo(name))
        except Exception as err:  # the reader's cache broke inside the model
            return report(CheckResult("FAIL", name, f"raised {describe_exception(err)} inside {MODEL}'s forward "
                                                    f"pass {where}"))
        for step, (got, want) in enumerate(zip(logits, expected_logits, strict=True)):
            phase = "the prefill" if step == 0 else f"decode step {step}"
            failure, diff = tensor_mismatch(name, got, want, 1e-4, 1e-4, f"{where}",
                                            subject=f"logits after {phase}:")
            if failure is not None:
                return report(failure)
            worst = max(worst, diff)
        failure = compare_token_runs(name, [tokens], [engine_tokens[index]],
                                     f"your cache in a greedy loop over {MODEL}, {label}",
                                     labels=[repr(ENGINE_PROMPTS[index])])
        if failure is not None:
            return report(failure)
    return report(CheckResult("PASS", name, max_diff=worst))

