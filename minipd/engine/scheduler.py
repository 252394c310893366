"""Deciding, each step, which requests run and how many of their tokens.

One token budget per step (``max_num_batched_tokens``) is shared by decodes (one token each) and
chunks of prefill, so a long prompt is split over several steps instead of stalling everyone
(chunked prefill). When the KV pool runs out, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
Nothing is lost; nothing deadlocks, because the oldest request can always make progress alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minipd.engine.request import Request, RequestStatus
from minipd.kv.block_manager import BlockManager


@dataclass
class ScheduledBatch:
    """One step's work: each request with how many tokens it computes this step."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class SchedulingPolicy:
    """Which queue gets the token budget first. Subclass and pass to :class:`Scheduler` to try others."""

    name = "decode-first"
    #: True: running requests (decodes, unfinished prefills) are served before new ones are admitted.
    running_first = True


class DecodeFirst(SchedulingPolicy):
    """Running requests first, then new ones in arrival order (vLLM's default): steady TPOT."""


class PrefillFirst(SchedulingPolicy):
    """New requests' prefills first, then the running decodes: lower TTFT, spikier TPOT."""

    name = "prefill-first"
    running_first = False


POLICIES: dict[str, type[SchedulingPolicy]] = {"decode-first": DecodeFirst, "fcfs": DecodeFirst,
                                               "prefill-first": PrefillFirst}


class Scheduler:
    """First-come-first-served scheduling with a token budget, a cap on running requests, and preemption."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: SchedulingPolicy | str = "decode-first") -> None:
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
            policy = POLICIES[policy]()
        self.policy = policy
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a new request behind those already waiting."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts, allocating the KV blocks they need."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.policy.running_first:
            budget = self._schedule_running(batch, budget)
            if not batch.preempted:
                self._schedule_waiting(batch, budget)
        else:
            budget = self._schedule_waiting(batch, budget)
            self._schedule_running(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        scheduled = {id(r) for r, _ in batch.entries}
        for request in list(self.running):
            if budget == 0:
                break
            if id(request) in scheduled or request.status is not RequestStatus.RUNNING:
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            while not self.block_manager.allocate(request.blocks, request.num_computed_tokens + num_new):
                victim, returned_budget = self._preempt_newest(batch)
                budget += returned_budget
                if victim is request:
                    break
            else:
                self._register(request, num_new)
                batch.entries.append((request, num_new))
                budget -= num_new
        return budget

    def _register(self, request: Request, num_new: int) -> None:
        self.block_manager.register_full_blocks(request.blocks, request.all_token_ids,
                                                request.num_computed_tokens + num_new)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(request.all_token_ids)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(request.blocks, num_cached + num_new, cached):
                break  # no room: wait for running requests to finish rather than preempt for a newcomer
            self.block_manager.record_lookup(request.num_tokens, num_cached)
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.metrics.cached_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self._register(request, num_new)
            self.running.append(request)
            batch.entries.append((request, num_new))
            budget -= num_new
        return budget

    def _preempt_newest(self, batch: ScheduledBatch) -> tuple[Request, int]:
        """Preempt the most recently admitted running request; return it and the budget it had this step."""
        victim = self.running.pop()
        # Its tokens scheduled this step will not run: only what was computed before is valid.
        self.block_manager.free_blocks(victim.blocks, victim.num_computed_tokens)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.metrics.preemptions += 1
        self.num_preemptions += 1
        returned = sum(n for r, n in batch.entries if r is victim)
        batch.entries = [(r, n) for r, n in batch.entries if r is not victim]
        batch.preempted.append(victim)
        self.waiting.appendleft(victim)
        return victim, returned

    def finish(self, request: Request) -> None:
        """Take a finished (or aborted) request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free_blocks(request.blocks)
