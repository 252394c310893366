"""The simplest KV cache: one preallocated (max_len, kv_heads, head_dim) buffer per layer for K and V.

It reserves room for a request's longest possible length up front, which is exactly the waste the
paged cache of chapter 03 removes; it is kept as the baseline to measure that against.
"""

from __future__ import annotations

import torch

from minipd.kv.base import KVCache
from minipd.layers.attention import attention

__all__ = ["ContiguousKVCache", "KVCache"]


class ContiguousKVCache:
    """K/V for one sequence in contiguous per-layer buffers sized for ``max_len`` tokens."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; appending would make {end}")
        self.k[layer_idx, self.length:end] = k
        self.v[layer_idx, self.length:end] = v
        return self.k[layer_idx, :end], self.v[layer_idx, :end]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        k_all, v_all = self.append(layer_idx, k, v)
        return attention(q, k_all, v_all, scale, sliding_window)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V, used or not."""
        return self.k.nbytes + self.v.nbytes
