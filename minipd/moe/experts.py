"""All SwiGLU experts of a layer as two stacked weights, run over rows grouped by expert.

``gate_up_proj`` (E, 2*I, H) holds each expert's gate rows then its up rows, the layout of
:class:`minipd.layers.mlp.SwiGLU`'s fused projection; ``down_proj`` is (E, H, I). Stacked weights let
one grouped matmul serve every expert, and they are the layout transformers 5 stores MoE weights in.

Two ways to run them here, same result (a third, a fused Triton kernel, in :mod:`minipd.kernels.fused_moe`):

* ``"grouped_mm"``: ``torch._grouped_mm`` with group offsets computed on the device, so the layer never
  waits for the host. Used on CUDA for bf16 on sm90/sm100 GPUs, where torch has a fused grouped kernel;
  for other GPUs and dtypes torch falls back to a per-group loop that copies the offsets to the host.
* ``"loop"``: one matmul pair per expert over its slice of rows. Slicing needs the counts on the host:
  one transfer per layer, which costs nothing on CPU. It is the CPU default because it is the plain
  reference and because ``torch.utils.flop_counter`` counts ``mm`` but not ``_grouped_mm``.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Implementation = Literal["auto", "grouped_mm", "loop", "triton"]
#: Every implementation, from the plain reference to the fused kernel (``moe_backend=``).
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "loop", "grouped_mm", "triton")


@functools.cache  # asked by every MoE layer in every forward: answer once per setting
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs natively (without a host sync) for these operands on ``device``.

    ``dims`` are the matrix sizes involved: both the CPU and CUDA kernels need 16-byte aligned row strides.
    """
    aligned = all(d * torch.empty((), dtype=dtype).element_size() % 16 == 0 for d in dims)
    if not hasattr(torch, "_grouped_mm") or not aligned:
        return False
    if device.type != "cuda":
        # torch 2.9+ ships a CPU kernel; on CPU a sync is free, so "supported" only means "it runs".
        return device.type == "cpu" and _cpu_grouped_mm_works()
    # torch's fused (CUTLASS) grouped kernel: bf16 on Hopper and Blackwell; anything else takes its host-sync loop.
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


_CPU_GROUPED_MM: bool | None = None


def _cpu_grouped_mm_works() -> bool:
    """Probe once: older torch builds have ``_grouped_mm`` but no CPU kernel for it."""
    global _CPU_GROUPED_MM
    if _CPU_GROUPED_MM is None:
        try:
            torch._grouped_mm(torch.ones(2, 4), torch.ones(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32))
            _CPU_GROUPED_MM = True
        except (RuntimeError, NotImplementedError):
            _CPU_GROUPED_MM = False
    return _CPU_GROUPED_MM


class StackedExperts(nn.Module):
    """``num_experts`` SwiGLU experts; :meth:`forward` maps rows grouped by expert to their outputs.

    ``implementation`` picks the path: ``"auto"`` (grouped on CUDA where native, else the loop),
    ``"grouped_mm"`` or ``"loop"`` (forced, e.g. to compare them). ``"triton"`` is run by the MoE layer
    itself (:mod:`minipd.kernels.fused_moe`: it permutes and multiplies in one pass, so it bypasses
    the dispatcher's copy); called here it falls back to the loop.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 implementation: Implementation = "auto") -> None:
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"moe_backend must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
                             f"got {implementation!r}")
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.implementation = implementation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices drawn like nn.Linear's (uniform in ±1/sqrt(fan_in))."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def uses_grouped_mm(self, hidden: torch.Tensor) -> bool:
        """Which path :meth:`forward` takes for ``hidden``."""
        if self.implementation in ("loop", "grouped_mm", "triton"):
            return self.implementation == "grouped_mm"
        return hidden.device.type == "cuda" and grouped_mm_supported(
            hidden.device, self.gate_up_proj.dtype, hidden.shape[-1], 2 * self.intermediate_size,
            self.intermediate_size)

    def forward(self, hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs (N, hidden) for rows ``hidden`` (N, hidden) grouped by expert, ``counts[e]`` rows for expert e."""
        if self.uses_grouped_mm(hidden):
            return self._grouped(hidden, counts)
        return self._loop(hidden, counts)

    def _grouped(self, hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # offs[e] is where expert e's rows end; computed on the device, so no host round trip.
        offs = counts.cumsum(0).to(torch.int32)
        # _grouped_mm multiplies by (E, in, out); the transposed view is the column-major operand it prefers.
        gate_up = torch._grouped_mm(hidden, self.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)

    def every_expert(self, rows: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """(T, hidden): each token's ``k`` chosen experts' outputs, weighted and summed, computed by running
        *every* expert on every row and keeping the chosen ones.

        No shape here depends on the routing, so a compiled program of fixed shape can hold it (the compiled
        decode step uses it): E/k times the arithmetic of running only the chosen experts, but a decode step
        of a few rows is bound by reading the weights, and a batch of a few tokens touches most experts
        anyway. Summed over each token's ``k`` slots in order, like :meth:`LocalDispatcher.combine`.
        """
        # Written as products summed over the inputs: compiled, each becomes one loop streaming the weights
        # (a batched matrix product of a few rows per expert ran 1.4x slower than the eager loop at 4 rows).
        gate_up = (rows[None, :, None, :] * self.gate_up_proj[:, None]).sum(-1)  # (E, T, 2I)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.silu(gate) * up
        out = (act[:, :, None, :] * self.down_proj[:, None]).sum(-1).transpose(0, 1)  # (T, E, hidden)
        chosen = out.gather(1, expert_ids.unsqueeze(-1).expand(-1, -1, out.shape[-1]))  # (T, k, hidden)
        return (chosen * weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)

    def _loop(self, hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The one host transfer of this path: the row count of every expert, to slice the batch.
        outputs = []
        for e, rows in enumerate(hidden.split(counts.tolist())):
            if rows.shape[0] == 0:
                continue  # an expert no token chose: nothing to compute, nothing to append
            gate, up = F.linear(rows, self.gate_up_proj[e]).split(self.intermediate_size, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outputs) if outputs else torch.empty_like(hidden)
