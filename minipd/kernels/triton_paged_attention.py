"""Triton versions of the paged-attention kernels in :mod:`minipd.kernels.paged_attention`.

Both kernels walk a sequence's keys in tiles of ``TILE_N`` positions. A tile does not have to line
up with the pool's blocks: each position looks up its own physical block in the block table, so
one tile may span several blocks (or part of one), and the block size only has to divide nothing.
Scores never leave the chip: an online softmax keeps, per query row, the running maximum ``m``,
the running sum of exponentials ``l`` and the unnormalised output ``acc``, and rescales them
whenever a later tile raises the maximum. Accumulation is in fp32 whatever the cache dtype.

- :func:`paged_decode_attention_triton`: one program per (sequence, KV head). The program loads the
  whole group of query heads that share that KV head, so each K/V byte is read once per group,
  not once per query head, which is what makes grouped-query attention cheap at decode time.
- :func:`paged_prefill_attention_triton`: one program per (sequence, tile of queries, query head),
  causal, every sequence's chunk in the same launch.

Both read quantized caches (``kv_cache_dtype="int8"``, ``"fp8"``, ``"int4_per_token"`` or KIVI's ``"int4"``)
too, dequantizing each tile in registers as it is loaded, so the memory traffic is the codes and their
scales; KIVI's filling blocks come from its residual window, in full precision.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this module and the same
kernels run, slowly, in the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minipd.kernels.triton_kv_store import last_dim_contiguous

__all__ = ["paged_decode_attention_triton", "paged_prefill_attention_triton"]

#: Smallest M, N and K ``tl.dot`` accepts on NVIDIA GPUs; smaller tiles are padded up to it.
_MIN_DOT = 16
#: Exponentials are taken base 2 (one hardware instruction); exp(x) = 2 ** (x * log2(e)).
_LOG2E = math.log2(math.e)


@triton.jit
def _load_kv_tile(cache_ptr, scale_ptr, residual_ptr, table_ptr, pos, in_range, kv_head, num_blocks,
                  stride_block, stride_off, stride_head, stride_s_block, stride_s_a, stride_s_b,
                  stride_r_slot, stride_r_off, stride_r_head,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, PER_CHANNEL: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """Gather rows ``pos`` (TILE_N,) of one sequence's K or V for one KV head: (TILE_N, HEAD_DIM).

    Position ``p`` lives in slot ``p % BLOCK_SIZE`` of physical block ``table[p // BLOCK_SIZE]``.
    Rows outside ``in_range`` read neither the table nor the pool and come back as zeros. A quantized
    cache (``QUANT`` 1: int8 codes, 2: fp8 e4m3 stored as bytes, 3: int4 nibbles two to a byte,
    4: KIVI int4) is dequantized here, in registers, so only the codes cross memory. A row's scale is
    one per token and KV head (scales at ``block * s_block + slot * s_a + head * s_b``), or with
    ``PER_CHANNEL`` one per dimension for the whole block (``block * s_block + head * s_a + dim * s_b``).
    With KIVI, block ids from ``num_blocks`` on name residual slots, read in full precision.
    """
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    from_codes = in_range
    if QUANT == 4:
        from_codes = in_range & (block < num_blocks)
    row = block * stride_block + slot * stride_off + kv_head * stride_head
    dims = tl.arange(0, HEAD_DIM)
    if QUANT >= 3:
        # Dimension d is in byte d // 2: its low nibble for even d, high for odd; stored as code + 8.
        packed = tl.load(cache_ptr + row[:, None] + (dims // 2)[None, :], mask=from_codes[:, None], other=0x88)
        tile = ((packed >> ((dims % 2) * 4)[None, :]) & 15).to(tl.int32) - 8
    else:
        tile = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=from_codes[:, None], other=0)
    if QUANT == 0:
        return tile
    if PER_CHANNEL:
        scale = tl.load(scale_ptr + (block * stride_s_block + kv_head * stride_s_a)[:, None]
                        + dims[None, :] * stride_s_b, mask=from_codes[:, None], other=0.0).to(tl.float32)
    else:
        scale = tl.load(scale_ptr + block * stride_s_block + slot * stride_s_a + kv_head * stride_s_b,
                        mask=from_codes, other=0.0).to(tl.float32)[:, None]
    if QUANT == 2:
        tile = tile.to(tl.float8e4nv, bitcast=True)
    values = tile.to(tl.float32) * scale
    if QUANT == 4:
        in_window = in_range & (block >= num_blocks)
        window_row = (block - num_blocks) * stride_r_slot + slot * stride_r_off + kv_head * stride_r_head
        exact = tl.load(residual_ptr + window_row[:, None] + dims[None, :], mask=in_window[:, None], other=0.0)
        values = tl.where(in_window[:, None], exact.to(tl.float32), values)
    return values.to(OUT_DTYPE)


@triton.jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr):
    """Fold one tile of keys into the running softmax state of every query row.

    ``q`` (M, D), ``k`` and ``v`` (N, D), ``allowed`` (M, N) says which scores count. Returns the
    updated ``(m_i, l_i, acc)``: the running max (in log2 units), the sum of ``2 ** (s - m_i)``
    and the matching weighted sum of values, all fp32.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Scores seen so far were exponentiated against the old max; shrink them to the new one.
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_residual_ptr, v_residual_ptr, out_ptr,
    block_tables_ptr, context_lens_ptr, scale_log2, window, num_blocks,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_c_block, stride_c_off, stride_c_head, stride_ks_block, stride_ks_a, stride_ks_b,
    stride_vs_block, stride_vs_a, stride_vs_b, stride_r_slot, stride_r_off, stride_r_head, stride_bt_seq,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(context_lens_ptr + seq)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    # The GROUP query heads sharing this KV head, padded to ROWS rows (tl.dot needs at least 16).
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    # With a sliding window only the last `window` keys count; skip the tiles before them.
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context - window, 0)
    m_i = tl.full((ROWS,), -1.0e30, tl.float32)  # finite, so an all-masked row never makes inf - inf
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range((first // TILE_N) * TILE_N, context, TILE_N):
        pos = start + offs_n
        in_range = (pos >= first) & (pos < context)
        k = _load_kv_tile(k_cache_ptr, k_scale_ptr, k_residual_ptr, table_ptr, pos, in_range, kv_head, num_blocks,
                          stride_c_block, stride_c_off, stride_c_head, stride_ks_block, stride_ks_a, stride_ks_b,
                          stride_r_slot, stride_r_off, stride_r_head, BLOCK_SIZE, HEAD_DIM, QUANT, QUANT == 4, q.dtype)
        v = _load_kv_tile(v_cache_ptr, v_scale_ptr, v_residual_ptr, table_ptr, pos, in_range, kv_head, num_blocks,
                          stride_c_block, stride_c_off, stride_c_head, stride_vs_block, stride_vs_a, stride_vs_b,
                          stride_r_slot, stride_r_off, stride_r_head, BLOCK_SIZE, HEAD_DIM, QUANT, False, q.dtype)
        allowed = row_ok[:, None] & in_range[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale_log2, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_residual_ptr, v_residual_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, context_lens_ptr, scale_log2, window, num_blocks,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_off, stride_c_head, stride_ks_block, stride_ks_a, stride_ks_b,
    stride_vs_block, stride_vs_a, stride_vs_b, stride_r_slot, stride_r_off, stride_r_head, stride_bt_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context = tl.load(context_lens_ptr + seq)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    # This program's queries: rows q_tile*BLOCK_M .. of the chunk, the last q_len of `context` positions.
    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    q_pos = context - q_len + offs_m
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    # Causality bounds the keys by the tile's last query; a window bounds them by its first.
    # A tile past the end of a short chunk gets end = 0, so its loop is empty and it stores nothing.
    last_row = tl.minimum(q_tile * BLOCK_M + BLOCK_M, q_len) - 1
    end = tl.where(q_tile * BLOCK_M < q_len, context - q_len + last_row + 1, 0)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context - q_len + q_tile * BLOCK_M - window + 1, 0)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range((first // TILE_N) * TILE_N, end, TILE_N):
        pos = start + offs_n
        in_range = (pos >= first) & (pos < end)
        k = _load_kv_tile(k_cache_ptr, k_scale_ptr, k_residual_ptr, table_ptr, pos, in_range, kv_head, num_blocks,
                          stride_c_block, stride_c_off, stride_c_head, stride_ks_block, stride_ks_a, stride_ks_b,
                          stride_r_slot, stride_r_off, stride_r_head, BLOCK_SIZE, HEAD_DIM, QUANT, QUANT == 4, q.dtype)
        v = _load_kv_tile(v_cache_ptr, v_scale_ptr, v_residual_ptr, table_ptr, pos, in_range, kv_head, num_blocks,
                          stride_c_block, stride_c_off, stride_c_head, stride_vs_block, stride_vs_a, stride_vs_b,
                          stride_r_slot, stride_r_off, stride_r_head, BLOCK_SIZE, HEAD_DIM, QUANT, False, q.dtype)
        allowed = row_ok[:, None] & in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale_log2, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  sliding_window: int | None = None, *,
                                  context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """One query per sequence: ``q`` (B, q_heads, D) against each sequence's paged K/V; returns (B, q_heads, D).

    Same contract as :func:`minipd.kernels.paged_attention.paged_decode_attention_torch`: the pool is
    (num_blocks, block_size, kv_heads, D), ``block_tables`` (B, max_blocks) int32, ``context_lens``
    (B,) int32 counting this step's token, whose K/V are already stored.
    """
    del context_lens_host  # the kernel reads lengths on the device
    batch, q_heads, head_dim = q.shape
    src = _unpack(q, k_cache, v_cache)
    k_cache, v_cache, quant = src.k, src.v, src.quant
    kv_heads = _check_pool(q, k_cache, v_cache, quant)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = q_heads // kv_heads
    q, block_tables = last_dim_contiguous(q), last_dim_contiguous(block_tables)
    fp32 = q.dtype == torch.float32
    _paged_decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, *src.pointers, out, block_tables, context_lens,
        scale * _LOG2E, sliding_window or 0, src.num_blocks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *src.strides, block_tables.stride(0),
        GROUP=group, ROWS=max(_MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], TILE_N=32 if fp32 else 64, HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if fp32 else None, QUANT=quant,
        num_warps=4,
    )
    return out


def paged_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                   context_lens: torch.Tensor, scale: float,
                                   sliding_window: int | None = None, *,
                                   query_start_host: Sequence[int] | None = None,
                                   context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """Chunks of queries, causal, variable lengths, in one launch; returns (N, q_heads, D).

    Same contract as :func:`minipd.kernels.paged_attention.paged_prefill_attention_torch`: sequence
    ``i``'s queries are rows ``query_start_loc[i]`` to ``query_start_loc[i + 1]`` of ``q`` and are
    the last of its ``context_lens[i]`` tokens, all of whose K/V are already in the pool.
    """
    num_tokens, q_heads, head_dim = q.shape
    src = _unpack(q, k_cache, v_cache)
    k_cache, v_cache, quant = src.k, src.v, src.quant
    kv_heads = _check_pool(q, k_cache, v_cache, quant)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    del context_lens_host
    # The grid is sized by the longest chunk: from the host copy when given, else one device sync.
    # Shorter chunks' extra tiles exit at once.
    if query_start_host is not None:
        longest = max(b - a for a, b in pairwise(query_start_host))
    else:
        longest = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if longest <= 0:
        return out
    fp32 = q.dtype == torch.float32
    block_m = 32 if fp32 else 64
    q, block_tables = last_dim_contiguous(q), last_dim_contiguous(block_tables)
    _paged_prefill_kernel[(batch, triton.cdiv(longest, block_m), q_heads)](
        q, k_cache, v_cache, *src.pointers, out, block_tables, query_start_loc, context_lens,
        scale * _LOG2E, sliding_window or 0, src.num_blocks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *src.strides, block_tables.stride(0),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m,
        TILE_N=32 if fp32 else 64, HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if fp32 else None, QUANT=quant,
        num_warps=4,
    )
    return out


#: The kernels' ``QUANT`` code for each quantized format (0: a plain floating-point cache).
_QUANT_CODES = {"int8": 1, "fp8": 2, "int4_per_token": 3, "int4": 4}


class _Sources(NamedTuple):
    """What the kernels read: values or codes, their scales, the residual window, and their strides."""

    k: torch.Tensor
    v: torch.Tensor
    quant: int
    #: K scales, V scales, K residual, V residual (stand-ins that are never read when there are none).
    pointers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    #: K scales' (block, a, b), V scales' (block, a, b), the residual's (slot, offset, head).
    strides: tuple[int, ...]
    #: Block ids from here on name residual slots (KIVI only).
    num_blocks: int


def _unpack(q: torch.Tensor, k_cache, v_cache) -> _Sources:
    """The tensors behind caches given as tensors, :class:`~minipd.kv.quant.QuantizedLayerCache` or
    :class:`~minipd.kv.residual.WindowedLayerCache`."""
    if not hasattr(k_cache, "codes"):
        return _Sources(k_cache, v_cache, 0, (k_cache, v_cache, k_cache, v_cache), (0,) * 9, 2**31 - 1)
    if k_cache.fmt.name not in _QUANT_CODES:
        raise ValueError(f"no Triton kernel reads kv_cache_dtype={k_cache.fmt.name!r}")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the cache dequantizes to {k_cache.dtype}")
    k_scales, v_scales = k_cache.scales, v_cache.scales
    strides = (*k_scales.stride()[:3], *v_scales.stride()[:3])
    if hasattr(k_cache, "residual"):
        residual_k, residual_v = k_cache.residual, v_cache.residual
        if residual_k.dtype != q.dtype:
            raise ValueError(f"q is {q.dtype} but the residual window holds {residual_k.dtype}")
        return _Sources(k_cache.codes, v_cache.codes, _QUANT_CODES[k_cache.fmt.name],
                        (k_scales, v_scales, residual_k, residual_v), (*strides, *residual_k.stride()[:3]),
                        k_cache.num_blocks)
    return _Sources(k_cache.codes, v_cache.codes, _QUANT_CODES[k_cache.fmt.name],
                    (k_scales, v_scales, k_scales, v_scales), (*strides, 0, 0, 0), 2**31 - 1)


def _check_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, quant: int = 0) -> int:
    """Validate the shapes the kernels rely on; return the number of KV heads."""
    q_heads, head_dim = q.shape[-2:]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must both be (num_blocks, block_size, kv_heads, head_dim), same layout")
    block_size, kv_heads, cache_dim = k_cache.shape[1:]
    if cache_dim * (2 if quant >= 3 else 1) != head_dim or k_cache.stride(-1) != 1:
        raise ValueError(f"cache rows must be contiguous and of size head_dim={head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be split evenly over {kv_heads} KV heads")
    if not _is_pow2(head_dim) or not _is_pow2(block_size):
        raise ValueError(f"head_dim ({head_dim}) and block_size ({block_size}) must be powers of two")
    if not quant and q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    return kv_heads


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0

