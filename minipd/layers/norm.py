"""RMSNorm: scale each vector to unit root-mean-square, then by a learned per-channel weight."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minipd.kernels.rms_norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """:func:`rms_norm` with its weight as a parameter."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernel: Callable[..., torch.Tensor] = rms_norm) -> torch.Tensor:
        """``kernel(x, weight, eps)``: the torch reference, or a backend's (``ForwardContext.kernels.rms_norm``)."""
        return kernel(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, computed by ``kernel`` (a backend's fused add + norm)."""
        return kernel(x, residual, self.weight, self.eps)
