"""A routed mixture of SwiGLU experts: router → dispatcher → stacked experts → combine.

Each stage is its own small piece in :mod:`minipd.moe`: the router picks ``top_k`` experts and weights
per token, the dispatcher groups the rows by expert, the stacked experts run every group (one grouped
matmul on CUDA), and the dispatcher's combine puts the weighted outputs back in token order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from minipd.kv.quant import fake_quantize
from minipd.layers.mlp import SwiGLU
from minipd.moe.capacity import enforce_capacity
from minipd.moe.dispatch import Dispatcher, LocalDispatcher
from minipd.moe.experts import Implementation, StackedExperts
from minipd.moe.router import Router, SigmoidGroupedRouter, SoftmaxRouter


class MoE(nn.Module):
    """``num_experts`` SwiGLU experts and a router; each token runs through ``top_k`` of them.

    Keyword options choose the router: ``scoring="softmax"`` (Mixtral; ``renormalize=False`` for
    Qwen-MoE without ``norm_topk_prob``) or ``scoring="sigmoid"`` (DeepSeek-V3: ``n_group``,
    ``topk_group``, ``routed_scaling_factor``, and ``renormalize`` as ``norm_topk_prob``).
    ``implementation`` picks the experts' matmul path (see :class:`~minipd.moe.experts.StackedExperts`)
    and ``dispatcher`` replaces the local one (e.g. with an expert-parallel all-to-all).
    ``shared_expert_intermediate_size`` adds Qwen2-MoE's shared expert and its sigmoid gate;
    ``shared_expert_gated=False`` adds it ungated, as DeepSeek-V3's ``n_shared_experts`` (one SwiGLU as
    wide as all of them together: the same function, since their outputs are simply summed).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 scoring: Literal["softmax", "sigmoid"] = "softmax", renormalize: bool = True, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0, implementation: Implementation = "auto",
                 dispatcher: Dispatcher | None = None, shared_expert_intermediate_size: int = 0,
                 shared_expert_gated: bool = True) -> None:
        super().__init__()
        self.router: Router
        if scoring == "softmax":
            if (n_group, topk_group, routed_scaling_factor) != (1, 1, 1.0):
                raise ValueError("n_group, topk_group and routed_scaling_factor apply to scoring='sigmoid' only")
            self.router = SoftmaxRouter(hidden_size, num_experts, top_k, renormalize)
        elif scoring == "sigmoid":
            self.router = SigmoidGroupedRouter(hidden_size, num_experts, top_k, n_group, topk_group,
                                               routed_scaling_factor, renormalize)
        else:
            raise ValueError(f"unknown router scoring {scoring!r} (expected 'softmax' or 'sigmoid')")
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(num_experts)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, implementation)
        # Qwen2-MoE: one more SwiGLU that every token goes through, scaled by a per-token sigmoid gate.
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(hidden_size, shared_expert_intermediate_size)
            if shared_expert_gated:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    #: When a list: each forward appends ``(tokens per expert (E,), mean entropy of the top-k weights)``,
    #: both on the host (``record_routing=True`` turns it on in the engine; it costs a sync per layer).
    routing_log: list[tuple[torch.Tensor, float]] | None = None
    #: Inference-time expert capacity (see :mod:`minipd.moe.capacity`): None for none, else its factor,
    #: and what happens to the assignments over it (``"drop"`` or ``"reroute"``).
    capacity_factor: float | None = None
    overflow: str = "drop"
    #: Round the rows sent to the experts to this per-token format (``"int8"``, ``"fp8"``): what an
    #: expert-parallel all-to-all would carry to cut its bytes. None: as computed.
    dispatch_format: str | None = None

    @property
    def top_k(self) -> int:
        """Experts per token."""
        return self.router.top_k

    def forward(self, x: torch.Tensor,
                silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The mixture's output for hidden states ``x`` (..., hidden), same shape and dtype (``silu_mul``: the
        shared expert's activation kernel, a backend's; None for the torch reference)."""
        hidden = x.reshape(-1, x.shape[-1])
        weights, expert_ids = self.router(hidden)
        capped = self.capacity_factor is not None
        if capped:
            if not isinstance(self.router, SoftmaxRouter) or not isinstance(self.dispatcher, LocalDispatcher):
                raise ValueError("moe_capacity_factor needs a softmax router and local experts")
            weights, expert_ids = enforce_capacity(self.router.probabilities(hidden), weights, expert_ids,
                                                   self.capacity_factor, self.overflow,  # type: ignore[arg-type]
                                                   self.router.renormalize)
        if self.routing_log is not None:
            self.routing_log.append(routing_summary(weights, expert_ids, self.router.num_experts))
        # The routed experts get the rows as a quantized all-to-all would deliver them (the shared expert
        # runs where the token is, on the rows as they are).
        local = isinstance(self.dispatcher, LocalDispatcher)
        fused = self.experts.implementation == "triton" and local
        # A compiled program has fixed shapes: no sorting rows by expert (see StackedExperts.every_expert).
        every = torch.compiler.is_compiling() and local and not capped
        if not (every or fused or capped):
            out = self.dispatcher.run(hidden, weights, expert_ids, self.experts, self.dispatch_format)
        else:
            rows = hidden if self.dispatch_format is None else fake_quantize(hidden, self.dispatch_format)
            if every:
                out = self.experts.every_expert(rows, weights, expert_ids)
            elif capped:
                # Over capacity, slots marked -1 are skipped (only the local dispatcher takes `dropped`).
                batch = self.dispatcher.dispatch(rows, weights, expert_ids, dropped=True)  # type: ignore[call-arg]
                out = self.dispatcher.combine(self.experts(batch.hidden, batch.counts), batch)
            else:
                from minipd.kernels.fused_moe import fused_moe_triton

                out = fused_moe_triton(rows, weights, expert_ids, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden) if silu_mul is None else self.shared_expert(hidden, silu_mul)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out.view(x.shape)


def routing_summary(weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, float]:
    """Tokens sent to each expert (E,) and the mean entropy (nats) of each token's top-k weights, renormalised:
    0 when one expert takes all the weight, ``log(top_k)`` when the weight is split evenly."""
    ids = expert_ids.reshape(-1)
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts).cpu()  # -1: dropped over capacity
    if weights.numel() == 0:
        return counts, 0.0
    p = weights.float() / weights.float().sum(dim=-1, keepdim=True).clamp_min(1e-20)
    entropy = -(p * p.clamp_min(1e-20).log()).sum(dim=-1).mean()
    return counts, float(entropy)
