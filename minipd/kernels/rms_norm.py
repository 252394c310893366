"""RMSNorm fused with the residual add that precedes it in every pre-norm block."""

from __future__ import annotations

import torch

from minipd.layers.norm import add_rms_norm


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; return ``(rms_norm(residual), residual)``."""
    return add_rms_norm(x, residual, weight, eps)
