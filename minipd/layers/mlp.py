"""SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minipd.kernels.activation import silu_and_mul


class SwiGLU(nn.Module):
    """The gated MLP of Llama-family models; ``gate`` and ``up`` run as one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # One fused projection halves the number of weight reads on the memory-bound decode path.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor,
                silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> torch.Tensor:
        """``silu_mul`` computes ``silu(gate) * up``: the torch reference, or a backend's
        (``ForwardContext.kernels.silu_mul``)."""
        return self.down_proj(silu_mul(self.gate_up_proj(x)))
