"""Expert capacity at inference time: what to do with the tokens an overloaded expert cannot take.

A router's choices are uneven: a few "hot" experts get many tokens, and on an expert-parallel
deployment the device holding them sets the pace of the step. A *capacity* bounds every expert's
load at ``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments per call (1.0: an even
share). The assignments past it (the lowest-weighted first: a token that wants an expert most keeps
it) are either

- ``"drop"``ped: that slot contributes nothing to its token (the token keeps its other experts and
  its residual stream), or
- ``"reroute"``d to the token's next-best expert that still has room and that it has not chosen
  already (the article's "probability resampling"), with the weights recomputed by the router's rule.

Either way the load evens out and the output drifts; :mod:`minipd.evaluation.kv_quality`'s measures (perplexity,
KL) price the drift. Dropped slots are marked with expert id -1, which the local dispatcher skips.
"""

from __future__ import annotations

import math

import torch

#: What happens to assignments over capacity.
OVERFLOW_POLICIES = ("drop", "reroute")


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert may take in a call of ``tokens`` tokens."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def enforce_capacity(probs: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, capacity_factor: float,
                     policy: str = "drop", renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing ``(weights, expert_ids)`` (T, k) with no expert over capacity.

    ``probs`` (T, E) are the router's probabilities over every expert (for rerouting). With
    ``renormalize`` (the router's rule) a rerouted token's weights are its final experts' probabilities
    rescaled to sum to 1; dropped slots get weight 0 and expert id -1.
    """
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(f"moe_overflow must be one of {', '.join(map(repr, OVERFLOW_POLICIES))}, got {policy!r}")
    tokens, top_k = expert_ids.shape
    num_experts = probs.shape[1]
    limit = capacity(tokens, top_k, num_experts, capacity_factor)
    weights, expert_ids = weights.clone(), expert_ids.clone()
    flat_ids, flat_w = expert_ids.reshape(-1), weights.reshape(-1)
    # Highest weight first, ties in token order; each assignment's rank within its expert in that order.
    priority = torch.sort(-flat_w, stable=True).indices
    onehot = torch.nn.functional.one_hot(flat_ids[priority], num_experts)
    rank = (onehot.cumsum(0) * onehot).sum(-1) - 1
    over = torch.zeros_like(flat_ids, dtype=torch.bool)
    over[priority] = rank >= limit
    if not bool(over.any()):
        return weights, expert_ids
    load = torch.bincount(flat_ids[~over], minlength=num_experts)
    flat_ids[over] = -1
    flat_w[over] = 0.0
    if policy == "reroute":
        ranked = probs.argsort(dim=-1, descending=True)
        for pair in priority[over[priority]].tolist():  # overflow, highest weight first
            token = pair // top_k
            taken = set(expert_ids[token].tolist())
            for expert in ranked[token].tolist():
                if expert not in taken and load[expert] < limit:
                    flat_ids[pair] = expert
                    load[expert] += 1
                    break
        kept = expert_ids >= 0
        chosen = probs.gather(1, expert_ids.clamp(min=0)) * kept
        if renormalize:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        rerouted = (weights == 0) & kept  # slots that found a new expert
        touched = rerouted.any(dim=-1, keepdim=True)
        weights = torch.where(touched, chosen, weights)
    return weights, expert_ids
