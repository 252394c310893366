"""Write a step's new K and V into their slots of the paged pool.

A slot is ``block_id * block_size + offset``; the pool for one layer is shaped
(num_blocks, block_size, kv_heads, head_dim), so slot ``s`` is row ``s`` of the pool viewed as
(num_blocks * block_size, kv_heads, head_dim). Negative slots (padding) are skipped.
"""

from __future__ import annotations

import torch


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, has_padding: bool = True) -> None:
    """Copy ``k``, ``v`` (N, kv_heads, head_dim) into the caches at ``slot_mapping`` (N,), in place
    (quantized, for a :class:`~minipd.kv.quant.QuantizedLayerCache`).

    ``has_padding=False`` promises there are no negative slots, which saves a device-to-host check
    (the model runner knows it once per step; the Triton kernel masks them at no cost either way).
    """
    if hasattr(k_cache, "store"):  # a quantized cache: it quantizes on the way in
        if has_padding:
            keep = slot_mapping >= 0
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        k_cache.store(slot_mapping, k)
        v_cache.store(slot_mapping, v)
        return
    if has_padding:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
