"""SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """The gated MLP of Llama-family models; ``gate`` and ``up`` run as one matmul."""

    #: ``silu(gate) * up`` in one pass over the fused projection's (rows, 2 × intermediate) output, returning
    #: None where it does not take the input; None for torch's ops. The engine sets minipd's C++ kernel where
    #: it runs them (:func:`minipd.kernels.cpu_norm_rope.silu_mul_cpu`: fp32 on a CPU, not while compiling,
    #: which fuses torch's ops itself).
    fused_silu_mul: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # One fused projection halves the number of weight reads on the memory-bound decode path.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        rows = None if self.fused_silu_mul is None else self.fused_silu_mul(gate_up)
        if rows is not None:
            return self.down_proj(rows.view(*gate_up.shape[:-1], self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
