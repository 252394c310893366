"""Chapter 03b exercises: attention kernels over a paged KV cache, plugged into minipd's engine.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck
reader can read it) and a checker (``check_<name>(fn)``) that prints PASS, FAIL or TODO. The two
kernel checkers first run the reader's kernel on seeded inputs, edge cases included, against
minipd's torch kernels (:mod:`minipd.kernels.paged_attention`); then they **plug it into the engine**
as one kernel of its backend (a :class:`~minipd.kernels.backend.KernelBackend` with that kernel
replaced) and run the bundled ``tiny-py`` greedily. Every call the engine makes is also computed by
minipd's kernel and compared, and the tokens must be the engine's own.

- ``check_paged_prefill_attention``: the kernel for prompt chunks (many queries per sequence, each
  after the sequence's cached tokens), run by an engine that prefills in chunks of at most 10 tokens;
- ``check_online_softmax_merge``: combining two partial softmax states (no engine: a pure function);
- ``check_split_k_decode``: decode attention computed in splits of the context, each split's softmax
  state merged into one (what production kernels do to keep a GPU busy at small batch), run as the
  engine's decode kernel.

The softmax state used here is the one the Triton kernel keeps per query row: ``m``, the largest
score seen; ``l``, the sum of ``exp(score - m)``; and ``acc``, the sum of ``exp(score - m) * v``.
The attention output is ``acc / l``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minipd.exercises.ch01 import MODEL, ReaderError, compare_token_runs, engine_llm, greedy_tokens
from minipd.exercises.checking import (
    Case,
    CheckResult,
    check_tensor_fn,
    compare_tensors,
    describe_exception,
    report,
    todo,
)
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from minipd.llm import LLM

__all__ = [
    "ENGINE_BLOCK_SIZE",
    "PREFILL_CHUNK",
    "SPLIT_SIZE",
    "KernelRecorder",
    "check_online_softmax_merge",
    "check_paged_prefill_attention",
    "check_split_k_decode",
    "reader_kernel",
    "reference_online_softmax_merge",
    "reference_paged_prefill_attention",
    "reference_split_k_decode",
]

#: The engine checks run ``tiny-py`` with blocks of 8 tokens...
ENGINE_BLOCK_SIZE = 8
#: ...decode in splits of 16 context tokens (two blocks; the prompts make two or three splits)...
SPLIT_SIZE = 16
#: ...and a token budget of 10 per step, so prompts of 9 to 22 tokens are prefilled in chunks.
PREFILL_CHUNK = 10


# --- reference solutions ------------------------------------------------------------------------


def _read_kv(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``positions`` of one sequence: slot ``p % block_size`` of block ``block_table[p // block_size]``."""
    block_size = cache.shape[1]
    return cache[block_table.long()[positions // block_size], positions % block_size]


def reference_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of chunks of queries over a paged cache, several sequences in one flat batch.

    ``q`` (N, q_heads, head_dim) holds sequence ``i``'s queries in rows ``query_start_loc[i]`` to
    ``query_start_loc[i + 1]``; they are the *last* of its ``context_lens[i]`` tokens, whose K/V (the
    new ones included) are already in ``k_cache``/``v_cache`` (num_blocks, block_size, kv_heads,
    head_dim) at the blocks of ``block_tables[i]``. Query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)``. Returns (N, q_heads, head_dim).
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i in range(len(context_lens)):
        start, end, context = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        positions = torch.arange(context)
        k = _read_kv(k_cache, block_tables[i], positions).float().repeat_interleave(group, dim=1)
        v = _read_kv(v_cache, block_tables[i], positions).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[start:end].float(), k) * scale
        # Query t is at position context - n + t: it sees keys up to there, not from the chunk's start.
        q_pos = torch.arange(context - (end - start), context)[:, None]
        scores = scores.masked_fill(positions[None, :] > q_pos, float("-inf"))
        out[start:end] = torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def reference_online_softmax_merge(m1: torch.Tensor, l1: torch.Tensor, acc1: torch.Tensor, m2: torch.Tensor,
                                   l2: torch.Tensor, acc2: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine the softmax states of two disjoint sets of keys into the state of their union.

    ``m`` and ``l`` are (rows,), ``acc`` (rows, head_dim). Each part's sums were taken relative to
    its own max; both are re-based on the common max ``m = max(m1, m2)`` by the factors
    ``exp(m1 - m)`` and ``exp(m2 - m)``, which are at most one, so nothing overflows. A part with no
    keys has ``m = -inf``, ``l = 0``, ``acc = 0`` and contributes nothing.
    """
    m = torch.maximum(m1, m2)
    scale1 = torch.exp(m1 - m)
    scale2 = torch.exp(m2 - m)
    l_sum = l1 * scale1 + l2 * scale2
    acc = acc1 * scale1[:, None] + acc2 * scale2[:, None]
    return m, l_sum, acc


def reference_split_k_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                             split_size: int) -> torch.Tensor:
    """Decode attention (one query per sequence) computed in splits of ``split_size`` context tokens.

    ``q`` is (B, q_heads, head_dim); sequence ``i`` has ``context_lens[i]`` tokens in the blocks of
    ``block_tables[i]``. Its context is cut into splits of ``split_size`` positions (the last may be
    shorter). Each split computes its own softmax state ``(m, l, acc)`` from its scores, as one GPU
    program would; the states are then merged with the online-softmax merge, and the output is
    ``acc / l``. Returns (B, q_heads, head_dim) in ``q``'s dtype.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i in range(q.shape[0]):
        m = torch.full((q.shape[1],), float("-inf"))
        l_sum = torch.zeros(q.shape[1])
        acc = torch.zeros(q.shape[1], q.shape[2])
        for start in range(0, int(context_lens[i]), split_size):
            positions = torch.arange(start, min(start + split_size, int(context_lens[i])))
            k = _read_kv(k_cache, block_tables[i], positions).float().repeat_interleave(group, dim=1)
            v = _read_kv(v_cache, block_tables[i], positions).float().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,thd->ht", q[i].float(), k) * scale  # this split's scores (q_heads, split)
            m_split = s.max(dim=1).values
            p = torch.exp(s - m_split[:, None])
            m, l_sum, acc = reference_online_softmax_merge(m, l_sum, acc, m_split, p.sum(dim=1),
                                                           torch.einsum("ht,thd->hd", p, v))
        out[i] = (acc / l_sum[:, None]).to(q.dtype)
    return out


# --- inputs, including edge cases ---------------------------------------------------------------


def _pool(g: torch.Generator, lens: list[int], block_size: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random K/V pool and a shuffled (len(lens), max_blocks) block table, padded with block 0."""
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    used = 0
    for i, n in enumerate(counts):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype), tables


def _prefill_case(g: torch.Generator, label: str, contexts: list[int], queries: list[int], q_heads: int,
                  kv_heads: int, block_size: int = 8, scale: float = 0.25) -> Case:
    k, v, tables = _pool(g, contexts, block_size, kv_heads, 16)
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), q_heads, 16, generator=g)
    return Case(label, (q, k, v, tables, starts, torch.tensor(contexts, dtype=torch.int32), scale))


def _prefill_cases(g: torch.Generator) -> list[Case]:
    return [
        _prefill_case(g, "one whole prompt of 19 tokens (queries = context)", [19], [19], 4, 2),
        _prefill_case(g, "a chunk of 5 queries after 12 cached tokens", [17], [5], 4, 2),
        _prefill_case(g, "three sequences: whole, a chunk, one query after 30 cached tokens",
                      [9, 20, 31], [9, 6, 1], 4, 2),
        _prefill_case(g, "GQA 8: 8 query heads share one KV head, chunk of 7 after 16", [23], [7], 8, 1,
                      block_size=16),
        _prefill_case(g, "large scores (scale 30): softmax must subtract the max", [14, 11], [4, 11], 4, 2,
                      scale=30.0),
    ]


def _minipd_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)


def _state(g: torch.Generator, rows: int, dim: int, shift: float = 0.0) -> tuple[torch.Tensor, ...]:
    """A valid softmax state of some random scores and values (``shift`` added to every score)."""
    keys = 5
    s = torch.randn(rows, keys, generator=g) * 3 + shift
    v = torch.randn(keys, dim, generator=g)
    m = s.max(dim=1).values
    p = torch.exp(s - m[:, None])
    return m, p.sum(dim=1), p @ v


def _merge_cases(g: torch.Generator) -> list[Case]:
    a, b = _state(g, 4, 8), _state(g, 4, 8)
    big1, big2 = _state(g, 3, 8, shift=1000.0), _state(g, 3, 8, shift=990.0)
    empty = (torch.full((4,), float("-inf")), torch.zeros(4), torch.zeros(4, 8))
    return [
        Case("two random parts", (*a, *b)),
        Case("scores near 1000 (exp(score) overflows)", (*big1, *big2)),
        Case("first part empty (m1 = -inf, l1 = 0)", (*empty, *b)),
        Case("second part empty", (*a, *empty)),
    ]


def _merged(*args: torch.Tensor) -> torch.Tensor:
    """The reference merge as one (rows, 2 + head_dim) tensor [m | l | acc], for comparison."""
    return _as_state_tensor(reference_online_softmax_merge(*args))


def _as_state_tensor(value: Any) -> torch.Tensor:
    if not (isinstance(value, tuple | list) and len(value) == 3 and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"returned {type(value).__name__}; expected a tuple (m, l, acc) of three tensors")
    m, l_sum, acc = value
    if m.dim() != 1 or l_sum.shape != m.shape or acc.dim() != 2 or acc.shape[0] != m.shape[0]:
        raise TypeError(f"returned shapes m {tuple(m.shape)}, l {tuple(l_sum.shape)}, acc {tuple(acc.shape)}; "
                        "expected (rows,), (rows,), (rows, head_dim)")
    return torch.cat([m[:, None], l_sum[:, None], acc], dim=1)


def _split_k_cases(g: torch.Generator) -> list[Case]:
    k, v, tables = _pool(g, [1, 16, 17, 50], block_size=8, kv_heads=2, head_dim=16)
    q = torch.randn(4, 8, 16, generator=g)
    lens = torch.tensor([1, 16, 17, 50], dtype=torch.int32)
    k1, v1, t1 = _pool(g, [23], block_size=16, kv_heads=1, head_dim=16)
    q1 = torch.randn(1, 8, 16, generator=g)
    return [
        Case("4 sequences of 1, 16, 17 and 50 tokens, splits of 16", (q, k, v, tables, lens, 0.25, 16)),
        Case("the same, splits of 8 (one block each)", (q, k, v, tables, lens, 0.25, 8)),
        Case("splits of 64: one split per sequence", (q, k, v, tables, lens, 0.25, 64)),
        Case("GQA 8: 8 query heads share one KV head, splits of 16", (q1, k1, v1, t1, torch.tensor([23]), 0.25, 16)),
        Case("large scores (scale 30): each split must subtract its max", (q, k, v, tables, lens, 30.0, 16)),
    ]


def _minipd_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, split_size: int) -> torch.Tensor:
    """minipd's decode kernel (which does not split: the answer must not depend on the splits)."""
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


# --- plugging a kernel into the engine -------------------------------------------------------------


class KernelRecorder:
    """An engine kernel that runs the reader's ``call`` and, on the same inputs, minipd's ``reference``.

    The engine continues with the reader's output; the first call whose output differs from minipd's
    by more than the tolerance is remembered (which call, the largest difference, where), and so is the
    largest difference over all calls.
    """

    def __init__(self, call: Callable[..., Any], reference: Callable[..., torch.Tensor], num_layers: int = 1,
                 atol: float = 1e-4, rtol: float = 1e-4) -> None:
        self.call, self.reference, self.num_layers = call, reference, num_layers
        self.atol, self.rtol = atol, rtol
        self.calls = 0
        self.worst = 0.0
        self.first_mismatch: str | None = None
        self.first_index: tuple[int, ...] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        q = args[0]
        cloned = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # the pool stays untouched
        out = self.call(*cloned, **kwargs)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
            got = (f"a {out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ReaderError(f"your kernel returned {got} for q of shape {tuple(q.shape)} ({q.dtype}); expected "
                              "the same shape and dtype as q")
        expected = self.reference(*args, **kwargs)
        ok, diff, first = compare_tensors(out, expected, self.atol, self.rtol)
        self.worst = max(self.worst, diff)
        if not ok and self.first_mismatch is None:
            assert first is not None
            self.first_index = first
            layer = self.calls % self.num_layers
            self.first_mismatch = (f"call {self.calls} (layer {layer}, {q.shape[0]} query rows): "
                                   f"max |diff| {diff:.3g}; first mismatch at index {first}: got "
                                   f"{out[first].item():.4g}, expected {expected[first].item():.4g}")
        self.calls += 1
        return out


def reader_kernel(llm: LLM, kernel: str, recorder: KernelRecorder) -> None:
    """Make ``llm``'s engine run ``recorder`` as its ``kernel`` (a field of :class:`KernelBackend`) from the
    next step on: the model runner reads its backend every step."""
    runner = llm.engine.core.runner
    runner.kernels = dataclasses.replace(runner.kernels, name=f"{runner.kernels.name}+reader", **{kernel: recorder})


def _check_kernel_in_engine(name: str, kernel: str, recorder: KernelRecorder, what: str, **options: Any
                            ) -> CheckResult:
    llm = engine_llm(block_size=ENGINE_BLOCK_SIZE, **options)
    expected = greedy_tokens(llm)  # no prefix caching: the second run recomputes everything
    recorder.num_layers = llm.config.num_hidden_layers
    reader_kernel(llm, kernel, recorder)
    where = f"plugged into {MODEL} as the engine's {what}"
    try:
        actual = greedy_tokens(llm)
    except NotImplementedError:
        return todo(name)
    except ReaderError as err:
        return CheckResult("FAIL", name, f"{where}: {err}")
    except Exception as err:  # the reader's kernel broke inside the engine
        return CheckResult("FAIL", name, f"{where}: raised {describe_exception(err)}")
    if recorder.calls == 0:
        return CheckResult("FAIL", name, f"{where}: the engine never called the kernel (a bug in the checker)")
    if recorder.first_mismatch is not None:
        return CheckResult("FAIL", name, f"{where}: differs from minipd's kernel at {recorder.first_mismatch}",
                           max_diff=recorder.worst, first_mismatch=recorder.first_index)
    return compare_token_runs(name, actual, expected, where) or CheckResult("PASS", name, max_diff=recorder.worst)


# --- checkers -----------------------------------------------------------------------------------


def check_paged_prefill_attention(fn: Callable[..., torch.Tensor]) -> CheckResult:
    """Check ``fn(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)``, then run it as the
    engine's prefill kernel.

    First against :func:`minipd.kernels.paged_attention.paged_prefill_attention_torch` on five seeded
    cases (whole prompts, chunks after cached tokens, several sequences in one batch, GQA, large
    scores). Then a fresh ``tiny-py`` (blocks of 8, at most 10 tokens per step, so its prompts are
    prefilled in chunks) calls ``fn`` for every prompt chunk of every layer: each output must match
    minipd's kernel within 1e-4, and the greedy tokens (three prompts, 16 each) the engine's own.
    """
    name = "paged_prefill_attention"
    result = check_tensor_fn(name, fn, _minipd_prefill, _prefill_cases, atol=1e-5, rtol=1e-4)
    if result.status != "PASS":
        return report(result)

    def call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
             sliding_window: int | None = None, **hosts: Any) -> Any:
        return fn(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)

    recorder = KernelRecorder(call, paged_prefill_attention_torch)
    return report(_check_kernel_in_engine(name, "paged_prefill_attention", recorder,
                                          f"prefill kernel (chunks of at most {PREFILL_CHUNK} tokens)",
                                          max_num_batched_tokens=PREFILL_CHUNK))


def check_online_softmax_merge(fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> CheckResult:
    """Check ``fn(m1, l1, acc1, m2, l2, acc2) -> (m, l, acc)``, compared as one [m | l | acc] tensor."""
    if not callable(fn):
        return report(check_tensor_fn("online_softmax_merge", fn, _merged, _merge_cases))

    def joined(*args: torch.Tensor) -> torch.Tensor:
        return _as_state_tensor(fn(*args))  # the reader's NotImplementedError passes straight through

    result = check_tensor_fn("online_softmax_merge", joined, _merged, _merge_cases, atol=1e-5, rtol=1e-5)
    where = result.first_mismatch
    if result.status == "FAIL" and where is not None and len(where) == 2:
        # The comparison ran on one [m | l | acc] tensor: say which of the three the index is in.
        row, column = where
        part = "m" if column == 0 else "l" if column == 1 else f"acc (column {column - 2})"
        result = dataclasses.replace(result, message=f"{result.message}; that is {part} of row {row}")
    return report(result)


def check_split_k_decode(fn: Callable[..., torch.Tensor]) -> CheckResult:
    """Check ``fn(q, k_cache, v_cache, block_tables, context_lens, scale, split_size)``, then run it as the
    engine's decode kernel.

    First against minipd's (unsplit) decode kernel on five seeded cases (lengths 1 to 50, splits of 8,
    16 and 64 tokens, GQA, large scores). Then a fresh ``tiny-py`` (blocks of 8) calls
    ``fn(..., split_size=16)`` for every decode step of every layer: each output must match minipd's
    kernel within 1e-4, and the greedy tokens (three prompts, 16 each) the engine's own.
    """
    name = "split_k_decode"
    result = check_tensor_fn(name, fn, _minipd_decode, _split_k_cases, atol=1e-5, rtol=1e-4)
    if result.status != "PASS":
        return report(result)

    def call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor, scale: float, sliding_window: int | None = None, **hosts: Any) -> Any:
        return fn(q, k_cache, v_cache, block_tables, context_lens, scale, SPLIT_SIZE)

    recorder = KernelRecorder(call, paged_decode_attention_torch)
    return report(_check_kernel_in_engine(name, "paged_decode_attention", recorder,
                                          f"decode kernel (splits of {SPLIT_SIZE} tokens)"))
