"""A routed mixture of SwiGLU experts (Mixtral style): softmax router, top-k, renormalised weights.

This is the plain reference form, looping over the experts that received tokens; the MoE chapter
builds the faster grouped and expert-parallel forms and checks them against this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipd.layers.mlp import SwiGLU


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token; weights are their softmax probabilities renormalised to 1."""
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class MoE(nn.Module):
    """``num_experts`` SwiGLU experts and a linear router; each token runs through ``top_k`` of them."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.router(x), self.top_k)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token_idx, slot = torch.where(experts == e)
            y = self.experts[e](x[token_idx]) * weights[token_idx, slot, None].to(x.dtype)
            out.index_add_(0, token_idx, y)
        return out
