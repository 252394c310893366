"""What a model layer needs from a KV cache, whatever keeps it (contiguous buffers or a paged pool)."""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    """What a layer needs from a cache: keep this step's K/V and attend over everything kept."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """Store ``k``, ``v`` (T, kv_heads, head_dim) for layer ``layer_idx``, then attend ``q`` (T, q_heads,
        head_dim) causally to all cached tokens; returns (T, q_heads, head_dim)."""
        ...

    # A cache for multi-head latent attention models (DeepSeek-V3) also has
    # ``attend_latent(layer_idx, q, rows, scale, up)``: it keeps one latent row per token instead of per-head
    # K/V (see :meth:`minipd.kv.paged_cache.PagedKVCache.attend_latent`). It is not part of this protocol
    # because caches of per-head K/V need not implement it.

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions as cached, once every layer has appended them."""
        ...
