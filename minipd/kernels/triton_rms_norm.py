"""Triton version of :func:`minipd.kernels.rms_norm.add_rms_norm_torch`: residual add fused with RMSNorm.

Unfused, the add writes ``x + residual`` to memory and the norm reads it straight back; fused,
one program per row reads ``x`` and ``residual`` once and writes the new residual and the
normalised row once, so the pair costs four row-sized memory passes instead of six. The
statistics are taken in fp32, like :func:`minipd.kernels.rms_norm.rms_norm`.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this module and the same
kernel runs, slowly, in the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm_triton"]


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res,
    hidden, eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    # Round the sum to the residual's dtype first, exactly as the unfused `x + residual` does.
    summed = (x.to(tl.float32) + res.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * stride_new_res + cols, summed, mask=mask)
    s32 = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(s32 * s32, 0) / hidden + eps)
    normed = (s32 * inv_rms).to(new_res_ptr.dtype.element_ty)  # the reference rounds before the weight too
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols,
             (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; return ``(rms_norm(residual), residual)`` over the last dimension.

    ``x`` and ``residual`` have the same shape (..., hidden); the new residual is a fresh tensor
    (the inputs are left as they were), and the normalised output has the dtype ``weight * x``
    would have in torch.
    """
    if x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit together")
    hidden = x.shape[-1]
    x2, res2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    weight = weight.contiguous()
    new_res = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, new_res.dtype), device=x.device)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(rows,)](
            x2, res2, weight, out, new_res,
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
            hidden, eps,
            BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out.view(x.shape), new_res.view(x.shape)
