"""The simplest KV cache: one preallocated (max_len, kv_heads, head_dim) buffer per layer for K and V.

It reserves room for a request's longest possible length up front, which is exactly the waste the
paged cache of chapter 03 removes; it is kept as the baseline to measure that against.
"""

from __future__ import annotations

import torch

from minipd.kernels.attention import attention
from minipd.kernels.mla import LatentUpProjection, absorbed_latent_attention, expanded_latent_attention
from minipd.kv.base import KVCache

__all__ = ["ContiguousKVCache", "KVCache"]


class ContiguousKVCache:
    """K/V for one sequence in contiguous per-layer buffers sized for ``max_len`` tokens.

    For a multi-head latent attention model, build it with ``num_kv_heads=1`` and ``head_dim`` the
    config's ``kv_latent_dim``: K then holds each token's latent row and V is not used.
    """

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

    def attend_latent(self, layer_idx: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
                      up: LatentUpProjection) -> torch.Tensor:
        """Append latent ``rows`` (T, latent_dim) and attend ``q`` (T, heads, nope + rope) to all of them;
        a single query in the absorbed form when ``up.absorb_decode``, else expanded."""
        end = self.length + rows.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; appending would make {end}")
        if self.k.shape[-2:] != (1, rows.shape[-1]):
            raise ValueError(f"a latent cache needs num_kv_heads=1 and head_dim={rows.shape[-1]}, this one has "
                             f"{tuple(self.k.shape[-2:])}")
        self.k[layer_idx, self.length:end, 0] = rows
        cached = self.k[layer_idx, :end, 0]
        if q.shape[0] == 1 and up.absorb_decode:
            out = absorbed_latent_attention(up.absorb_query(q), cached[None], None, scale, up.kv_lora_rank)
            return up.project_values(out)
        return expanded_latent_attention(q, cached, scale, up)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V, used or not."""
        return self.k.nbytes + self.v.nbytes
