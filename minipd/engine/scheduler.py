"""Deciding, each step, which requests run and how many of their tokens.

One token budget per step (``max_num_batched_tokens``) is shared by decodes (one token each) and
chunks of prefill, so a long prompt is split over several steps instead of stalling everyone
(chunked prefill). When the KV pool runs out, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
Nothing is lost; nothing deadlocks, because the oldest request can always make progress alone.

A step is a transaction: :meth:`Scheduler.schedule` picks the work, and only :meth:`Scheduler.commit`
(after the model ran) advances the requests and registers their finished blocks for prefix reuse;
:meth:`Scheduler.rollback` undoes a step that raised, so no request ever reads K/V never written.

Requests whose first tokens' K/V come from elsewhere (a prefill worker) get their blocks allocated,
wait in ``waiting_for_kv`` without using the token budget, and resume computing after
:meth:`Scheduler.kv_arrived`. A finished request created with ``hold_kv`` keeps its blocks until
:meth:`Scheduler.release_kv`, so a receiver can read them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minipd.engine.request import FinishReason, Request, RequestStatus
from minipd.kv.block_manager import BlockManager, block_hashes


@dataclass
class ScheduledBatch:
    """One step's work: each request with how many tokens it computes this step."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: Prefix-cache lookups counted this step, (request, tokens queried, tokens hit): undone by a rollback.
    lookups: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class StepUpdate:
    """What :meth:`Scheduler.update` did with one step's results, for the step's record."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    #: Tokens each request of the step attends to, summed (its context after the step).
    num_context_tokens: int = 0
    prefill_chunk_sizes: tuple[int, ...] = ()
    #: Each prefill chunk's request's computed tokens after the step (its context).
    prefill_chunk_contexts: tuple[int, ...] = ()
    #: Requests whose new token ended them (out of the queues; holding K/V if they asked to).
    finished: list[Request] = field(default_factory=list)


class SchedulingPolicy:
    """Which queue gets the token budget first. Subclass and pass to :class:`Scheduler` to try others."""

    name = "decode-first"
    #: True: running requests (decodes, unfinished prefills) are served before new ones are admitted.
    running_first = True
    #: True: a step that has prefill work (unfinished or new prompts) carries no decodes.
    exclusive = False


class DecodeFirst(SchedulingPolicy):
    """Running requests first, then new ones in arrival order (vLLM's default): steady TPOT."""


class PrefillFirst(SchedulingPolicy):
    """New requests' prefills first, then the running decodes: lower TTFT, spikier TPOT."""

    name = "prefill-first"
    running_first = False


class PrefillOnly(SchedulingPolicy):
    """A step is all prefill (unfinished prompts, then new requests) whenever there is any to do; decodes step
    only when there is none (vLLM's scheduler before chunked prefill, 2023): low TTFT, and every decode stalls
    while a prompt is computed — the interference that prefill/decode disaggregation removes."""

    name = "prefill-only"
    running_first = False
    exclusive = True


POLICIES: dict[str, type[SchedulingPolicy]] = {"decode-first": DecodeFirst, "fcfs": DecodeFirst,
                                               "prefill-first": PrefillFirst, "prefill-only": PrefillOnly}


class Scheduler:
    """First-come-first-served scheduling with a token budget, a cap on running requests, and preemption."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: SchedulingPolicy | str = "decode-first", *,
                 make_room: Callable[[], bool] | None = None) -> None:
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
        #: Requests holding blocks while their external K/V arrive, by id.
        self.waiting_for_kv: dict[str, Request] = {}
        #: Finished requests whose blocks are kept until released, by id.
        self.holding_kv: dict[str, Request] = {}
        self.num_preemptions = 0
        #: Tried before preempting when a running request needs a block: True if it freed some (adaptive KV
        #: precision compresses a full-precision request in place). A hook given by whoever builds the scheduler.
        self.make_room = make_room
        # Hashes of blocks that this step's work completes: a newcomer whose prefix continues into
        # one of them waits a step and then reuses it, instead of computing the same tokens twice.
        self._completing: set[bytes] = set()

    def add(self, request: Request) -> None:
        """Queue a new request behind those already waiting."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request is waiting, waiting for K/V, or running."""
        return bool(self.waiting or self.running or self.waiting_for_kv)

    @property
    def num_active(self) -> int:
        """Requests that hold blocks and count against ``max_num_seqs``."""
        return len(self.running) + len(self.waiting_for_kv)

    # --------------------------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts, allocating the KV blocks they need.

        All or nothing: if anything raises half-way (a policy, an allocation), what was scheduled so far
        is rolled back before the error goes on, so no request is left holding blocks for a step that
        never ran."""
        batch = ScheduledBatch()
        self._completing.clear()
        budget = self.max_num_batched_tokens
        try:
            if self.policy.running_first:
                budget = self._schedule_running(batch, budget)
                if not batch.preempted:
                    self._schedule_waiting(batch, budget)
            elif self.policy.exclusive:  # prefill steps (unfinished prompts, then new ones) or decode steps
                budget = self._schedule_running(batch, budget, prefills_only=True)
                if not batch.preempted:
                    budget = self._schedule_waiting(batch, budget)
                if not batch.entries:
                    self._schedule_running(batch, budget)
            else:
                budget = self._schedule_waiting(batch, budget)
                self._schedule_running(batch, budget)
        except BaseException:
            self.rollback(batch)
            raise
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, prefills_only: bool = False) -> int:
        scheduled = {id(r) for r, _ in batch.entries}
        allocate, running = self.block_manager.allocate, RequestStatus.RUNNING
        prefix_caching = self.block_manager.enable_prefix_caching
        # (This loop runs once per running request per step, the simulator's hottest: no property calls.)
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running or id(request) in scheduled:
                continue
            uncomputed = len(request.all_token_ids) - request.num_computed_tokens
            if prefills_only and request.is_decode(uncomputed):
                continue
            num_new = uncomputed if uncomputed < budget else budget
            if num_new == 0:
                continue
            while not allocate(request.blocks, request.num_computed_tokens + num_new):
                if self.make_room is not None and self.make_room():
                    continue  # room made without losing work (adaptive KV precision compressed a request)
                victim, returned_budget = self._preempt_newest(batch)
                budget += returned_budget
                if victim is request:
                    break
            else:
                if prefix_caching:
                    self._schedule(batch, request, num_new)
                else:  # (what _schedule does without prefix caching, without its call)
                    batch.entries.append((request, num_new))
                budget -= num_new
        return budget

    def _schedule(self, batch: ScheduledBatch, request: Request, num_new: int) -> None:
        batch.entries.append((request, num_new))
        bm = self.block_manager
        if bm.enable_prefix_caching:
            bs = bm.block_size
            first, end = request.num_computed_tokens // bs, (request.num_computed_tokens + num_new) // bs
            if end > first:
                hashes = block_hashes(request.all_token_ids, bs, request.block_hashes)
                self._completing.update(hashes[first:end])

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and self.num_active < self.max_num_seqs:
            request = self.waiting[0]
            cached: list[int] | None
            if request.blocks.block_table:  # its external K/V arrived: it resumes with the blocks it holds
                num_cached, cached = request.num_computed_tokens, None
            else:
                cached = self._cached_prefix(request)
                if cached is None:
                    break  # its prefix is being computed this step: reuse it next step
                num_cached = len(cached) * bm.block_size
            if request.num_external_tokens > num_cached:
                # Blocks for K/V that another worker sends: allocated now, filled outside any step.
                if not bm.allocate(request.blocks, request.num_external_tokens):
                    break
                self.waiting.popleft()
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.waiting_for_kv[request.request_id] = request
                continue
            num_new = min(request.num_tokens - num_cached, budget)
            if not bm.allocate(request.blocks, num_cached + num_new, cached or ()):
                if cached is not None and self._resume_holder_first():
                    continue  # (a head that holds blocks itself is never swapped: two holders would alternate)
                break  # no room: wait for running requests to finish rather than preempt for a newcomer
            if cached is not None:
                bm.record_lookup(request.num_tokens, num_cached)
                batch.lookups.append((request, request.num_tokens, num_cached))
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.num_cached_tokens += len(cached or ()) * bm.block_size
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(batch, request, num_new)
            budget -= num_new
        return budget

    def _resume_holder_first(self) -> bool:
        """Move a waiting request that already holds blocks (its K/V arrived) to the front; False if none.

        It needs fewer new blocks than the head, and until it runs its blocks help no one: leaving it
        behind a head that cannot fit could leave the pool full with nothing running.
        """
        for index, request in enumerate(self.waiting):
            if index and request.blocks.block_table:
                del self.waiting[index]
                self.waiting.appendleft(request)
                return True
        return False

    def _cached_prefix(self, request: Request) -> list[int] | None:
        """Blocks of the request's committed cached prefix; None when the next block is being computed now."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # (a cached token is not computed, so it could not be scored)
        usable = (request.num_tokens - 1) // bm.block_size
        hashes = block_hashes(request.all_token_ids[:usable * bm.block_size], bm.block_size, request.block_hashes)
        cached = bm.find_cached_prefix(request.all_token_ids, hashes)
        if len(cached) < usable and hashes[len(cached)] in self._completing:
            return None
        return cached

    def _preempt_newest(self, batch: ScheduledBatch) -> tuple[Request, int]:
        """Preempt the most recently admitted running request; return it and the budget it had this step."""
        victim = self.running.pop()
        self._reset(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        returned = sum(n for r, n in batch.entries if r is victim)
        batch.entries = [(r, n) for r, n in batch.entries if r is not victim]
        batch.preempted.append(victim)
        self.waiting.appendleft(victim)
        return victim, returned

    def _reset(self, request: Request) -> None:
        """Free everything the request holds; it will be recomputed from its (cached) prefix."""
        self.block_manager.free_blocks(request.blocks)
        request.num_computed_tokens = 0
        # K/V that came from elsewhere are gone with the blocks; the tokens are known, so recompute them.
        request.num_external_tokens = 0
        request.status = RequestStatus.WAITING

    # ------------------------------------------------------------------------- after the step
    def update(self, batch: ScheduledBatch, sampled: list[Request], tokens: list[int], start: float) -> StepUpdate:
        """The executor ran ``batch`` (it started at ``start``) and sampled ``tokens`` for ``sampled``:
        commit the step, append the tokens, and take finished requests out of the queues."""
        # Request.is_decode for each entry, asked before the commit advances them (inline: once per row of every step).
        decodes = [n == 1 and r.num_computed_tokens + 1 == len(r.all_token_ids) > r.num_prompt_tokens
                   for r, n in batch.entries]
        self.commit(batch)
        context = decode_rows = 0
        chunk_sizes: list[int] = []
        chunk_contexts: list[int] = []
        for (request, n), is_decode in zip(batch.entries, decodes, strict=True):
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
            context += request.num_computed_tokens
            if is_decode:
                decode_rows += 1
            else:
                chunk_sizes.append(n)
                chunk_contexts.append(request.num_computed_tokens)
                request.num_prefill_tokens += n
        update = StepUpdate(num_prefill_tokens=sum(chunk_sizes), num_decode_tokens=decode_rows,
                            num_context_tokens=context, prefill_chunk_sizes=tuple(chunk_sizes),
                            prefill_chunk_contexts=tuple(chunk_contexts))
        for request, token in zip(sampled, tokens, strict=True):
            request.append_token(token)
            if request.finish_reason is not None:
                self.finish(request)
                update.finished.append(request)
        return update

    def commit(self, batch: ScheduledBatch) -> None:
        """The model ran: advance each request and register its newly full blocks for reuse."""
        bm = self.block_manager
        for request, n in batch.entries:
            request.num_computed_tokens += n
            if bm.enable_prefix_caching:
                bm.register_full_blocks(request.blocks, request.all_token_ids, request.num_computed_tokens,
                                        request.block_hashes)
        self._completing.clear()

    def rollback(self, batch: ScheduledBatch) -> None:
        """The step raised: put its requests back to waiting, in order, holding nothing written this step.

        Their committed blocks stay registered, so readmission recomputes only what the step lost;
        the prefix-cache lookups the step counted are taken back, since readmission counts them again.
        """
        self._completing.clear()
        stats = self.block_manager.stats
        for request, queried, hit in batch.lookups:
            stats.queried_tokens -= queried
            stats.hit_tokens -= hit
            request.num_cached_tokens -= hit
        for request, _ in reversed(batch.entries):
            if request in self.running:
                self.running.remove(request)
            self._reset(request)
            self.waiting.appendleft(request)

    def kv_arrived(self, request_id: str) -> Request:
        """The external K/V of a request in ``waiting_for_kv`` are in its blocks: it may compute the rest."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} is not waiting for KV")
        self.add_with_kv(request)
        return request

    def add_with_kv(self, request: Request) -> None:
        """Queue, at the front, a request whose blocks already hold its first ``num_external_tokens`` tokens' K/V."""
        request.num_computed_tokens = request.num_external_tokens
        self.block_manager.register_full_blocks(request.blocks, request.all_token_ids,
                                                request.num_computed_tokens, request.block_hashes)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a finished (or aborted) request out of the queues; free its blocks unless it holds them."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_kv.pop(request.request_id, None)
        if request.hold_kv and request.blocks.block_table and request.finish_reason is not FinishReason.ABORT:
            request.status = RequestStatus.FINISHED_HOLDING_KV
            self.holding_kv[request.request_id] = request
            return
        request.status = RequestStatus.FINISHED
        self.block_manager.free_blocks(request.blocks)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished request was holding; False if it holds none."""
        request = self.holding_kv.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.FINISHED
        self.block_manager.free_blocks(request.blocks)
        return True
