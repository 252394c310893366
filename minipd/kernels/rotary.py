"""RoPE's rotation, the torch reference: what :mod:`minipd.layers.rotary` applies and the backends' kernels
(``KernelBackend.rotary``) are checked against.

The HF layout pairs channel ``i`` with ``i + head_dim / 2``; turning each pair by its angle is
``x * cos + rotate_half(x) * sin``.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map channel halves ``(a, b)`` to ``(-b, a)``: the 90° turn used by the HF layout of RoPE."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., tokens, heads, head_dim) by per-token angles given as cos and sin."""
    return x * cos + rotate_half(x) * sin


__all__ = ["apply_rotary", "rotate_half"]
