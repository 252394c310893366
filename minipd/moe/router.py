"""Routers: score every expert for every token and keep ``top_k`` of them.

A router answers one question, "which experts, with what weights", as a pair of tensors
``(weights (T, k) fp32, expert_ids (T, k) int64)``. The rest of the MoE layer sees only that pair, so
the scoring rule of a model family is the one thing that changes from family to family:

* :class:`SoftmaxRouter`: softmax over all experts, top-k, optionally renormalised (Mixtral, Qwen-MoE);
* :class:`SigmoidGroupedRouter`: independent sigmoid scores, a per-expert bias that steers the choice
  only, top-k restricted to the best expert groups (DeepSeek-V3).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True,
                 selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts by softmax probability, and their probabilities.

    With ``renormalize`` the kept probabilities are rescaled to sum to 1 (Mixtral; Qwen-MoE's
    ``norm_topk_prob``); without it they keep their share of the full softmax. ``selection_bias`` (E,)
    is added to the probabilities for the choice only, never to the weights (DeepSeek-V3's
    loss-free balancing, here on softmax scores).
    """
    # fp32 softmax: bf16 probabilities of near-equal experts would tie and make top-k arbitrary.
    probs = F.softmax(router_logits.float(), dim=-1)
    if selection_bias is None:
        weights, expert_ids = probs.topk(top_k, dim=-1)
    else:
        expert_ids = (probs + selection_bias).topk(top_k, dim=-1).indices
        weights = probs.gather(-1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def sigmoid_grouped_topk(router_logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
                         n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                         normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores, biased choice within the best groups, unbiased weights.

    The experts are split into ``n_group`` equal groups; a group is rated by the sum of its two best
    biased scores and only the ``topk_group`` best groups compete for the ``top_k`` slots (on a real
    deployment a group is one node, so a token's experts span at most ``topk_group`` nodes). ``bias``
    balances the load by nudging which experts win; it never enters the weights, which are the plain
    sigmoid scores of the winners, optionally normalised to sum to 1, times ``routed_scaling_factor``.
    """
    scores = router_logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        tokens, num_experts = choice.shape
        per_group = num_experts // n_group
        group_rating = choice.view(tokens, n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        best_groups = group_rating.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_rating, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    expert_ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if normalize:
        # The epsilon only guards an all-zero row (every sigmoid underflowed); it changes nothing else.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids


class Router(nn.Module, ABC):
    """A linear scorer ``weight`` (num_experts, hidden) and a rule turning scores into a top-k choice.

    Subclasses implement :meth:`forward`; the parameter is named ``weight`` so an HF ``gate.weight``
    loads straight into ``router.weight``.
    """

    #: Route with the gate weights rounded to this format (``"int8"``, ``"int4"``), one scale per expert
    #: row: what a deployment that ships quantized gates computes. None: as stored.
    weight_format: str | None = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def gate_weight(self) -> torch.Tensor:
        """The weight routing uses: as stored, or its round trip through :attr:`weight_format`."""
        if self.weight_format is None:
            return self.weight
        from minipd.kv.quant import fake_quantize

        return fake_quantize(self.weight, {"int8": "int8", "int4": "int4_per_token"}[self.weight_format])

    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation, so a model built without a checkpoint still routes sensibly."""
        bound = 1 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)

    @abstractmethod
    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, expert_ids)``, both (T, top_k), for hidden states (T, hidden); weights are fp32."""


class SoftmaxRouter(Router):
    """Softmax over all experts, then top-k (Mixtral, Qwen-MoE); see :func:`softmax_topk`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool = True) -> None:
        super().__init__(hidden_size, num_experts, top_k)
        self.renormalize = renormalize
        #: Added to the probabilities when choosing experts, not when weighting them (None: no bias); set by
        #: loss-free load balancing (:mod:`minipd.evaluation.router_training`).
        self.selection_bias: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Logits in the model's dtype, as the reference implementations compute them; softmax in fp32.
        return softmax_topk(F.linear(hidden, self.gate_weight()), self.top_k, self.renormalize, self.selection_bias)

    def probabilities(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, E) fp32 softmax over every expert (what rerouting an overflowing token ranks by)."""
        return F.softmax(F.linear(hidden, self.gate_weight()).float(), dim=-1)


class SigmoidGroupedRouter(Router):
    """Sigmoid scores with a selection-only bias and grouped top-k (DeepSeek-V3); see :func:`sigmoid_grouped_topk`.

    ``e_score_correction_bias`` is a parameter (frozen) rather than a buffer so the weight loader
    fills it from the checkpoint and reports it when missing.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, normalize: bool = True) -> None:
        super().__init__(hidden_size, num_experts, top_k)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"need num_experts % n_group == 0 and 0 < topk_group <= n_group, got "
                             f"{num_experts=}, {n_group=}, {topk_group=}")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k={top_k} exceeds the {topk_group} kept groups' experts")
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.normalize = normalize
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 logits: the bias shifts scores by small amounts that bf16 would round away.
        logits = F.linear(hidden.float(), self.gate_weight().float())
        return sigmoid_grouped_topk(logits, self.top_k, self.e_score_correction_bias, self.n_group,
                                    self.topk_group, self.routed_scaling_factor, self.normalize)
