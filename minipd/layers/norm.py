"""RMSNorm: scale each vector to unit root-mean-square, then by a learned per-channel weight."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dimension of ``x`` by its root mean square.

    The statistics are taken in fp32 whatever the input dtype, as HF's Llama does, so bf16 runs
    stay close to fp32 ones.
    """
    if x.dtype == torch.float32:  # the same arithmetic without two no-op casts (they cost on CPU)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``, then ``(rms_norm(residual), residual)``: the pre-norm block's add and norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """:func:`rms_norm` with its weight as a parameter."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, computed by ``kernel`` (a backend's fused add + norm)."""
        return kernel(x, residual, self.weight, self.eps)
