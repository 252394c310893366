"""RMSNorm, and RMSNorm fused with the residual add that precedes it in every pre-norm block: the torch
reference the kernels are checked against, and what :class:`minipd.layers.norm.RMSNorm` computes.

Under the name the backends share, the fused form is ``add_rms_norm_torch``:
``(rms_norm(x + residual), x + residual)``.
"""

from __future__ import annotations

import torch


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


#: The fused add + norm under the name every backend's version has (``add_rms_norm_triton``, ...).
add_rms_norm_torch = add_rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_torch", "rms_norm"]
