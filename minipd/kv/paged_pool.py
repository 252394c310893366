"""The paged KV pool: per layer, K and V stored in fixed-size blocks that any sequence can own."""

from __future__ import annotations

import torch

from minipd.config import ModelConfig


class PagedKVPool:
    """K and V for every layer, shaped (num_layers, num_blocks, block_size, kv_heads, head_dim)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def num_tokens(self) -> int:
        """How many tokens the pool holds when every block is full."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes taken by K and V together."""
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def blocks_for_budget(config: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks fit in ``memory_bytes`` of K and V."""
        per_token = config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
        return max(1, memory_bytes // (per_token * block_size))
