"""Weight-only int8 linears (``weight_dtype="int8"``): a quarter of fp32's weight bytes, read per step.

Each output row of a weight gets one scale (``max|row| / 127``) and int8 codes; a call multiplies with
``torch._weight_int8pack_mm``, which dequantizes the codes on the fly. Its fast kernels take bf16
activations, so the input is rounded to bf16 for the product and the output cast back: this, more
than the int8 codes, is what changes the numbers, and the quality cost is measured like chapter 06's
KV formats (``python -m minipd kvquality --methods weights-int8``). A decode step reads every weight once, so
a quarter of the bytes is what a memory-bound step needs; the embedding table stays as it was.
"""

from __future__ import annotations

import torch
from torch import nn

#: The activation dtype the int8 product runs in (torch's int8-weight kernels take bf16).
ACTIVATION_DTYPE = torch.bfloat16


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of ``weight`` (out, in) with one fp32 scale per output row: ``weight ≈ codes * scale``."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


class Int8Linear(nn.Module):
    """A linear layer holding int8 codes and per-row scales instead of its float weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scales = quantize_rows(linear.weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales.to(ACTIVATION_DTYPE))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight the codes stand for (fp32; built on each access, for inspection and tests)."""
        return self.codes.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACTIVATION_DTYPE)
        out = torch._weight_int8pack_mm(flat, self.codes, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear` (tied heads get their own codes)."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        raise ValueError("weight_dtype='int8' needs torch._weight_int8pack_mm (torch >= 2.4)")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
                swapped += 1
    return swapped


__all__ = ["ACTIVATION_DTYPE", "Int8Linear", "quantize_linears", "quantize_rows"]
