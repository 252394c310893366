"""Dispatchers: bring each token to the experts its router chose, and the experts' answers back.

Experts run fastest on one contiguous block of rows per expert, but a token's ``top_k`` choices are
scattered over all experts. A dispatcher makes the blocks (:meth:`Dispatcher.dispatch`) and undoes
them, weighting and summing each token's ``top_k`` answers (:meth:`Dispatcher.combine`). The MoE layer
talks to this interface only, so going expert-parallel means writing one more dispatcher: its
``dispatch`` sends rows to the rank that owns their expert (an all-to-all) and its ``combine`` sends
the answers home (a second all-to-all) before the same weighted sum.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from minipd.kv.quant import fake_quantize


@dataclass
class ExpertBatch:
    """The rows this device's experts must process, grouped by expert.

    ``hidden`` (N, hidden): the rows of local expert 0, then those of expert 1, and so on.
    ``counts`` (num_local_experts,) int64: rows per expert, on ``hidden``'s device so building the batch
    never waits for the host. Subclasses add what their dispatcher needs to :meth:`~Dispatcher.combine`.
    """

    hidden: torch.Tensor
    counts: torch.Tensor


BatchT = TypeVar("BatchT", bound=ExpertBatch)


class Dispatcher(ABC, Generic[BatchT]):
    """Moves (T, hidden) token rows to per-expert batches and the experts' outputs back to (T, hidden)."""

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> BatchT:
        """Group the rows of ``hidden`` (T, hidden) by the experts ``expert_ids`` (T, k) chose for them.

        ``weights`` (T, k) are the routing weights; the batch carries them for :meth:`combine`.
        """

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, batch: BatchT) -> torch.Tensor:
        """(T, hidden): each token's ``k`` expert outputs, weighted by its routing weights and summed.

        ``expert_out`` (N, hidden) is row-aligned with ``batch.hidden``.
        """

    def run(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: Callable,
            row_format: str | None = None) -> torch.Tensor:
        """The whole expert stage: dispatch, ``experts(rows, counts)``, combine; (T, hidden) out.

        ``row_format`` (``"int8"``, ``"fp8"``): the rows reach the experts rounded to it, as a compressed
        all-to-all would deliver them. A dispatcher that overlaps moving rows with computing on them
        (:class:`~minipd.moe.expert_parallel.ExpertParallelDispatcher`) overrides this.
        """
        rows = hidden if row_format is None else fake_quantize(hidden, row_format)
        batch = self.dispatch(rows, weights, expert_ids)
        return self.combine(experts(batch.hidden, batch.counts), batch)


@dataclass
class LocalExpertBatch(ExpertBatch):
    """A batch for experts on this device: ``order`` and ``weights`` let :meth:`LocalDispatcher.combine` undo it.

    ``order`` (N,): row ``r`` of ``hidden`` is flattened (token, slot) pair ``order[r]``, i.e. token
    ``order[r] // k``. ``weights`` (T, k): the routing weights, in the router's layout.
    """

    order: torch.Tensor
    weights: torch.Tensor


class LocalDispatcher(Dispatcher[LocalExpertBatch]):
    """All experts live here: dispatch is a sort of the (token, slot) pairs by expert, combine its inverse.

    Every step stays on the device (no ``.item()``/``.tolist()``), so the layer can run without a host
    sync; only the experts decide whether they need the counts on the host.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                 dropped: bool = False) -> LocalExpertBatch:
        """As :meth:`Dispatcher.dispatch`; with ``dropped``, ids of -1 mark slots to skip (over an expert's
        capacity): they get no row, and counting the kept ones costs one host sync."""
        flat_ids = expert_ids.reshape(-1)
        if dropped:  # skipped slots sort last, out of every expert's run
            flat_ids = torch.where(flat_ids < 0, self.num_experts, flat_ids)
        # Stable, so within an expert the rows keep token order (deterministic, and easy to read).
        order = flat_ids.argsort(stable=True)
        # scatter_add rather than bincount: CUDA bincount reads the max id on the host to size its output.
        counts = torch.zeros(self.num_experts + dropped, dtype=torch.int64, device=flat_ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        if dropped:
            counts = counts[:self.num_experts]
            order = order[:int(counts.sum())]
        rows = hidden.index_select(0, order // expert_ids.shape[-1])
        return LocalExpertBatch(hidden=rows, counts=counts, order=order, weights=weights)

    def combine(self, expert_out: torch.Tensor, batch: LocalExpertBatch) -> torch.Tensor:
        tokens, k = batch.weights.shape
        # Un-permute with a scatter (order is a permutation, so no two rows collide), then a weighted sum
        # over each token's k slots: deterministic, unlike an atomic index_add over the sorted rows.
        # Skipped slots (fewer rows than slots) stay zero.
        by_slot = expert_out.new_zeros(tokens * k, expert_out.shape[-1]) if expert_out.shape[0] < tokens * k \
            else torch.empty_like(expert_out)
        by_slot.index_copy_(0, batch.order, expert_out)
        weighted = by_slot.view(tokens, k, expert_out.shape[-1]) * batch.weights.to(expert_out.dtype).unsqueeze(-1)
        return weighted.sum(dim=1)
