"""SwiGLU's activation, the torch reference: ``silu(gate) * up`` from the fused gate/up projection's output,
what :class:`minipd.layers.mlp.SwiGLU` applies and the backends' kernels (``KernelBackend.silu_mul``) are
checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` (..., 2 x width) holding ``gate`` then ``up``: (..., width)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


__all__ = ["silu_and_mul"]
