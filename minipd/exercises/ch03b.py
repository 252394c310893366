"""Chapter 03b exercises: reading a paged KV cache, and the online softmax behind the attention kernel.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck
reader can read it) and a checker (``check_<name>(fn)``) that runs the reader's function on seeded
inputs, including edge cases, and prints PASS, FAIL or TODO. The checkers compare against the
engine's own kernels in :mod:`minipd.kernels.paged_attention` where they exist.

The softmax state used here is the one the Triton kernel keeps per query row: ``m``, the largest
score seen; ``l``, the sum of ``exp(score - m)``; and ``acc``, the sum of ``exp(score - m) * v``.
The attention output is ``acc / l``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minipd.exercises.checking import Case, CheckResult, check_tensor_fn, report
from minipd.kernels.paged_attention import gather_kv, paged_decode_attention_torch

__all__ = [
    "check_online_softmax_merge",
    "check_paged_decode_one_sequence",
    "check_paged_gather",
    "reference_online_softmax_merge",
    "reference_paged_decode_one_sequence",
    "reference_paged_gather",
]


# --- reference solutions ------------------------------------------------------------------------


def reference_paged_gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows of one sequence from a paged ``cache``, in order: (length, kv_heads, head_dim).

    ``cache`` is (num_blocks, block_size, kv_heads, head_dim); position ``p`` of the sequence is in
    slot ``p % block_size`` of physical block ``block_table[p // block_size]``. The table may list
    more blocks than ``length`` needs.
    """
    block_size = cache.shape[1]
    rows = []
    for p in range(length):
        rows.append(cache[int(block_table[p // block_size]), p % block_size])
    return torch.stack(rows)


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


def reference_paged_decode_one_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                        block_table: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """Decode attention for one sequence, one cache block at a time, with an online softmax.

    ``q`` is (q_heads, head_dim); query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.
    Returns (q_heads, head_dim). Never holds more than one block of scores at once.
    """
    q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    qf = q.float()
    m = torch.full((q_heads,), float("-inf"))
    l_sum = torch.zeros(q_heads)
    acc = torch.zeros(q_heads, head_dim)
    for b in range((length + block_size - 1) // block_size):
        used = min(block_size, length - b * block_size)  # the last block may be partly filled
        k = k_cache[int(block_table[b]), :used].float().repeat_interleave(group, dim=1)  # (used, q_heads, D)
        v = v_cache[int(block_table[b]), :used].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", qf, k) * scale  # (q_heads, used)
        m_blk = s.max(dim=1).values
        p = torch.exp(s - m_blk[:, None])
        m, l_sum, acc = reference_online_softmax_merge(m, l_sum, acc, m_blk, p.sum(dim=1),
                                                       torch.einsum("ht,thd->hd", p, v))
    return (acc / l_sum[:, None]).to(q.dtype)


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


def _gather_cases(g: torch.Generator) -> list[Case]:
    cache, _, tables = _pool(g, [19, 16, 1, 40], block_size=8, kv_heads=2, head_dim=4)
    return [
        Case("19 tokens in shuffled blocks of 8 (last block part full)", (cache, tables[0], 19)),
        Case("16 tokens: exactly two full blocks", (cache, tables[1], 16)),
        Case("1 token", (cache, tables[2], 1)),
        Case("30 tokens from a 5-block table (the table lists more than needed)", (cache, tables[3], 30)),
    ]


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


def _decode_cases(g: torch.Generator) -> list[Case]:
    k, v, tables = _pool(g, [1, 16, 19, 50], block_size=8, kv_heads=2, head_dim=16)
    q = torch.randn(4, 8, 16, generator=g)
    k1, v1, t1 = _pool(g, [23], block_size=16, kv_heads=1, head_dim=16)
    cases = [
        Case("context 1", (q[0], k, v, tables[0], 1, 0.25)),
        Case("16 tokens, two full blocks, GQA 4", (q[1], k, v, tables[1], 16, 0.25)),
        Case("19 tokens, last block part full", (q[2], k, v, tables[2], 19, 0.25)),
        Case("50 tokens in 7 shuffled blocks", (q[3], k, v, tables[3], 50, 0.25)),
        Case("GQA 8: 8 query heads share one KV head", (q[0], k1, v1, t1[0], 23, 0.25)),
        Case("large scores (scale 30): needs the running max", (q[3], k, v, tables[3], 50, 30.0)),
    ]
    return cases


def _minipd_decode_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       length: int, scale: float) -> torch.Tensor:
    """minipd's batched decode reference on a batch of one."""
    lens = torch.tensor([length], dtype=torch.int32)
    return paged_decode_attention_torch(q[None], k_cache, v_cache, block_table[None], lens, scale)[0]


# --- checkers -----------------------------------------------------------------------------------


def check_paged_gather(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> CheckResult:
    """Check ``fn(cache, block_table, length)`` against :func:`minipd.kernels.paged_attention.gather_kv`."""
    return report(check_tensor_fn("paged_gather", fn, gather_kv, _gather_cases, atol=0.0, rtol=0.0))


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


def check_paged_decode_one_sequence(fn: Callable[..., torch.Tensor]) -> CheckResult:
    """Check ``fn(q, k_cache, v_cache, block_table, length, scale)`` against minipd's decode attention."""
    return report(check_tensor_fn("paged_decode_one_sequence", fn, _minipd_decode_one, _decode_cases,
                                  atol=1e-5, rtol=1e-4))
