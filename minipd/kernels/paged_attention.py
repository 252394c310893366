"""Attention over a paged KV cache: decode (one query per sequence) and prefill (a chunk of queries).

The pool for one layer is (num_blocks, block_size, kv_heads, head_dim). Sequence ``i`` owns the
blocks listed in ``block_tables[i]`` (padded with any valid id past its end) and has
``context_lens[i]`` tokens in them, counting the new tokens of this step, whose K/V are already
stored. Queries are always the last tokens of their sequence's context.

The lengths also come as Python lists (``context_lens_host``, ``query_start_host``), which the
model runner builds once per step: with them a kernel needs no device-to-host copy in every layer.
The cache may be stored in another dtype than the queries (``kv_cache_dtype``); it is read in the
queries' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minipd.kernels.attention import attention


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence, contiguous: (length, kv_heads, head_dim)."""
    block_size = cache.shape[1]
    blocks = (length + block_size - 1) // block_size
    return cache[block_table[:blocks]].flatten(0, 1)[:length]


def _as_queries(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return kv if kv.dtype == q.dtype else kv.to(q.dtype)


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 sliding_window: int | None = None, *,
                                 context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """One query per sequence: ``q`` (B, q_heads, D) against each sequence's paged K/V; returns (B, q_heads, D).

    Sequences are gathered into padded (B, S, kv_heads, D) tensors and masked past their length,
    so a batch is a few attention calls instead of B small ones. Padding is wasted work, so the
    sequences are first sorted by length and split into a few groups, each padded to its own longest.
    """
    batch = q.shape[0]
    lengths = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    if batch == 1:
        # A lone sequence needs no padding and so no mask: gather exactly its (windowed) context.
        length = lengths[0]
        first = max(0, length - sliding_window) if sliding_window is not None else 0
        k = _as_queries(gather_kv(k_cache, block_tables[0], length)[first:], q).transpose(0, 1).unsqueeze(0)
        v = _as_queries(gather_kv(v_cache, block_tables[0], length)[first:], q).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
        return out.squeeze(2)
    order = sorted(range(batch), key=lengths.__getitem__)
    groups = [order[i * batch // DECODE_GROUPS:(i + 1) * batch // DECODE_GROUPS] for i in range(DECODE_GROUPS)]
    groups = [g for g in groups if g]
    if len(groups) == 1:
        return _padded_decode(q, k_cache, v_cache, block_tables, context_lens, max(lengths), scale, sliding_window)
    out = torch.empty_like(q)
    for group in groups:
        idx = torch.tensor(group, device=q.device)
        out[idx] = _padded_decode(q[idx], k_cache, v_cache, block_tables[idx], context_lens[idx],
                                  lengths[group[-1]], scale, sliding_window)
    return out


#: Length groups a decode batch is split into (see :func:`paged_decode_attention_torch`).
DECODE_GROUPS = 4


def decode_attention_with_new(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float, window: int) -> torch.Tensor:
    """One query per sequence over its paged context, whose last position is ``k_new``/``v_new`` (B, KVH, D),
    not the pool (the pool's slot for it need not be written yet). Static shapes, no host reads: what a
    compiled decode step (:mod:`minipd.engine.compiled_decode`) runs.

    ``block_tables`` (B, W) spans ``W * block_size`` positions; positions at or past ``context_lens`` are
    masked, so padding columns may name any valid block. ``window`` <= 0 means no sliding window.
    """
    return _padded_decode(q, k_cache, v_cache, block_tables, context_lens, block_tables.shape[1] * k_cache.shape[1],
                          scale, None if window <= 0 else window, k_new, v_new)


def _padded_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, longest: int, scale: float, sliding_window: int | None,
                   k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    batch, _, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = -(-longest // block_size)
    span = blocks * block_size
    tables = block_tables[:, :blocks]
    k = k_cache[tables].view(batch, span, kv_heads, dim)
    v = v_cache[tables].view(batch, span, kv_heads, dim)
    pos = torch.arange(span, device=q.device)[None, :]
    lens = context_lens.to(q.device)[:, None]
    if k_new is not None and v_new is not None:
        # The last position from the new rows, rounded to the cache's dtype as a stored row would be.
        is_new = (pos == lens - 1)[:, :, None, None]
        k = torch.where(is_new, k_new[:, None].to(k.dtype), k)
        v = torch.where(is_new, v_new[:, None].to(v.dtype), v)
    k, v = _as_queries(k, q).transpose(1, 2), _as_queries(v, q).transpose(1, 2)
    mask = pos < lens
    if sliding_window is not None:
        mask &= pos >= lens - sliding_window
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)


def paged_prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float,
                                  sliding_window: int | None = None, *,
                                  query_start_host: Sequence[int] | None = None,
                                  context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """Chunks of queries, causal, variable lengths, in one call.

    ``q`` (N, q_heads, D) holds sequence ``i``'s queries in rows ``query_start_loc[i]`` to
    ``query_start_loc[i + 1]`` (a (B + 1,) int tensor); they are the last of its ``context_lens[i]``
    tokens. Returns (N, q_heads, D).
    """
    out = torch.empty_like(q)
    starts = list(query_start_host) if query_start_host is not None else query_start_loc.tolist()
    contexts = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    for i, context in enumerate(contexts):
        start, end = starts[i], starts[i + 1]
        k = _as_queries(gather_kv(k_cache, block_tables[i], context), q)
        v = _as_queries(gather_kv(v_cache, block_tables[i], context), q)
        out[start:end] = attention(q[start:end], k, v, scale, sliding_window)
    return out
