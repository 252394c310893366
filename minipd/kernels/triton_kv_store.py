"""Triton version of :func:`minipd.kernels.kv_store.store_kv_torch`: scatter new K/V rows into the pool.

One program per new token copies that token's K and V (all KV heads at once) into the slot that
``slot_mapping`` names. A negative slot is padding: its program writes nothing. The copy is pure
data movement, so its speed is bytes moved over time, and the kernel just has to keep every load
and store wide and contiguous along ``head_dim``.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this module and the same
kernel runs, slowly, in the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipd.kernels.kv_store import store_kv_torch

__all__ = ["store_kv_triton"]


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_off, stride_c_head,
    num_heads, block_size,
    HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    # int64 before multiplying by strides: a large pool has more elements than an int32 can address.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_DIM)
    # Padding tokens (slot < 0) get an all-false mask, so they touch neither input nor cache.
    live_heads = tl.where(slot >= 0, num_heads, 0)
    mask = heads[:, None] < live_heads
    block = slot // block_size
    offset = slot % block_size
    src_k = k_ptr + token.to(tl.int64) * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = v_ptr + token.to(tl.int64) * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst = block * stride_c_block + offset * stride_c_off + heads[:, None] * stride_c_head + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, has_padding: bool = True) -> None:
    """Copy ``k``, ``v`` (N, kv_heads, head_dim) into the caches at ``slot_mapping`` (N,), in place.

    The caches are (num_blocks, block_size, kv_heads, head_dim) with a contiguous last dimension;
    ``k`` and ``v`` may be strided views (e.g. slices of a fused qkv projection) as long as their
    last dimension is contiguous. Negative slots are skipped (masked in the kernel, so
    ``has_padding`` changes nothing here). A quantized cache is written by the torch reference,
    which quantizes.
    """
    if hasattr(k_cache, "store"):  # a quantized cache quantizes on the way in (see minipd.kv.quant)
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping, has_padding=has_padding)
        return
    del has_padding
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.shape != v_cache.shape or k_cache.shape[-2:] != (num_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold rows of shape {(num_heads, head_dim)}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout with a contiguous last dimension")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, k_cache.shape[1],
        HEADS_P2=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
    )


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has stride 1, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()
