"""RMSNorm, the residual add + RMSNorm, RoPE and SwiGLU's activation, each in one C++ pass over fp32 activations
(``cpu_norm_rope.cpp``, ``cpu_swiglu.cpp``, built with the CPU attention kernels): what the ``"cpu"`` kernel
backend runs in eager steps, above all prefill, where torch spends a chain of elementwise ops on each.

Every function has the torch reference's signature and falls back to it for what the kernel does not take:
other dtypes or devices, tensors that need gradients, code being compiled (the compiler fuses torch's ops
itself), or no built kernel.
"""

from __future__ import annotations

import torch

from minipd.kernels.activation import silu_and_mul
from minipd.kernels.cpu_paged_attention import load_kernel
from minipd.kernels.rms_norm import add_rms_norm_torch, rms_norm
from minipd.kernels.rotary import apply_rotary


def takes_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels may compute on ``tensors``: fp32 CPU tensors, no gradient to record, and no
    compilation under way (asked first: the compiler must not trace the kernels' loading)."""
    if torch.compiler.is_compiling():
        return False
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _kernel(name: str):
    module, _ = load_kernel()
    return getattr(module, name, None)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As :func:`~minipd.kernels.rms_norm.rms_norm`, in one pass per row."""
    kernel = _kernel("rms_norm_f32") if takes_kernel(x, weight) else None
    if kernel is None or x.shape[-1] != weight.numel():
        return rms_norm(x, weight, eps)
    return kernel(x.contiguous(), weight.contiguous(), float(eps))


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`~minipd.kernels.rms_norm.add_rms_norm`: ``(rms_norm(x + residual), x + residual)``, each row
    read once."""
    kernel = _kernel("add_rms_norm_f32") if takes_kernel(x, residual, weight) else None
    if kernel is None or x.shape != residual.shape or x.shape[-1] != weight.numel():
        return add_rms_norm_torch(x, residual, weight, eps)
    normed, summed = kernel(x.contiguous(), residual.contiguous(), weight.contiguous(), float(eps))
    return normed, summed


def apply_rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As :func:`~minipd.kernels.rotary.apply_rotary` for ``x`` (tokens, heads, head_dim) and ``cos``, ``sin``
    (tokens, 1, head_dim); the result is contiguous."""
    kernel = _kernel("rotary_f32") if takes_kernel(x, cos, sin) else None
    tokens = x.shape[0] if x.dim() == 3 else -1
    if kernel is None or x.dim() != 3 or x.shape[-1] % 2 or cos.shape != (tokens, 1, x.shape[-1]) \
            or sin.shape != cos.shape:
        return apply_rotary(x, cos, sin)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return kernel(x, cos.contiguous(), sin.contiguous())


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """As :func:`~minipd.kernels.activation.silu_and_mul`: ``silu(gate) * up`` of a (..., 2 x width) fused
    projection output, in one pass."""
    kernel = _kernel("silu_mul") if takes_kernel(gate_up) else None
    if kernel is None or gate_up.shape[-1] % 2:
        return silu_and_mul(gate_up)
    rows = kernel(gate_up.reshape(-1, gate_up.shape[-1]).contiguous())
    return rows.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


__all__ = ["add_rms_norm_cpu", "apply_rotary_cpu", "rms_norm_cpu", "silu_mul_cpu", "takes_kernel"]
