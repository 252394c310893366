"""The step loop of an engine core, on plain data: a scheduler, an executor and a clock it is given.

:class:`StepCore` is everything a continuous-batching core does that does not touch a tensor:
requests in and out, one step as a transaction (schedule, execute, commit or roll back), the
outputs, the step records and the errors kept until the step's tokens are delivered. What runs
the model is an *executor* (``execute(batch) -> StepResult``) and time comes from a *clock*, both
passed in, so the same loop drives the real engine (:class:`~minipd.engine.core.EngineCore`, whose
executor is the :class:`~minipd.engine.model_runner.ModelRunner`) and a simulator (a fake executor
that returns step times from a model, a clock that jumps). Importing this module does not import
torch.

What differs between cores hangs on named hooks, each a no-op here: :meth:`_before_step` (work owed
from a failed step), :meth:`_with_arrivals` (K/V that arrived let waiting requests compute),
:meth:`_enter_step` / :meth:`_leave_step` (thread counts), :meth:`_after_tokens` (the eviction press),
:meth:`_extra_stats`, :meth:`_run_ended`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, Request, RequestStatus
from minipd.engine.scheduler import ScheduledBatch, Scheduler, StepUpdate
from minipd.engine.stats import StepStats
from minipd.errors import ParameterError

logger = logging.getLogger("minipd")


class StepResult(NamedTuple):
    """What an executor gives back for one step."""

    #: Requests that got a new token (see :meth:`Request.samples_after`), and those tokens.
    sampled: list[Request]
    tokens: list[int]
    #: For each sampled request, {token id: log-probability} when it asked for ``logprobs``.
    logprobs: list[dict[int, float] | None]
    #: For requests asking for ``prompt_logprobs``: one dict per prompt token computed this step.
    prompt_logprobs: dict[str, list[dict[int, float]]]


class Executor(Protocol):
    """Runs one scheduled batch: the model (:class:`~minipd.engine.model_runner.ModelRunner`) or a stand-in."""

    def execute(self, batch: ScheduledBatch) -> StepResult: ...


def check_fits_pool(num_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int,
                    what: str = "the request", pool: str = "the pool has") -> None:
    """Refuse a request that could never fit a pool of ``num_blocks``, however long it waited (a
    :class:`~minipd.errors.ParameterError` whose ``param`` is ``what``)."""
    longest = min(max_model_len, num_tokens + max_tokens)
    # The last sampled token is never fed back, so its K/V never need a slot.
    blocks = -(-(longest - 1) // block_size)
    if blocks > num_blocks:
        raise ParameterError(what, f"{what} may grow to {longest} tokens ({blocks} KV blocks) but {pool} "
                                   f"{num_blocks} blocks; raise num_kv_blocks or lower max_tokens")


def record_step(stats: StepStats, history: deque[StepStats], callbacks: list[Callable[[StepStats], None]]) -> None:
    """Keep a step's record and hand it to every callback; a callback's bug is logged, never raised (it
    must not lose the step's tokens)."""
    history.append(stats)
    for callback in callbacks:
        try:
            callback(stats)
        except Exception:
            logger.exception("step callback %r failed; the step's outputs are kept", callback)


class StepCore:
    """Requests in, one transactional step at a time, :class:`EngineCoreOutputs` out.

    Args:
        scheduler: decides each step's batch (over its :class:`~minipd.kv.block_manager.BlockManager`).
        executor: computes a batch's next tokens.
        max_model_len: the longest sequence a request may grow to.
        clock: seconds, monotonic (``time.perf_counter`` by default; a simulator passes its own).
        stats_history: how many recent :class:`StepStats` records are kept (0, with no
            :attr:`step_callbacks`: none is built, as in the simulator, which steps millions of times).
        run_delay: the stepping thread's seconds spent waiting for a core so far, or None where unknown
            (:func:`~minipd.engine.run_delay.thread_run_delay`); each record's ``cpu_wait`` is its growth over
            the step. None (a simulator's default): not measured.
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, max_model_len: int, *,
                 clock: Callable[[], float] = time.perf_counter, stats_history: int = 10_000,
                 run_delay: Callable[[], float | None] | None = None) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.executor = executor
        self.max_model_len = max_model_len
        self.clock = clock
        self.run_delay = run_delay
        #: Live requests (waiting, running, waiting for K/V, or finished but holding K/V), by id.
        self.requests: dict[str, Request] = {}
        #: The most recent steps' records (a ring buffer: a long-running service does not grow).
        self.step_stats: deque[StepStats] = deque(maxlen=stats_history)
        #: Called with every step's record, for consumers that keep their own (metrics exporters).
        self.step_callbacks: list[Callable[[StepStats], None]] = []
        self.num_steps = 0
        self._failure: Exception | None = None

    # ---------------------------------------------------------------------------------- requests
    def check_fits(self, num_tokens: int, max_tokens: int, what: str = "the request") -> None:
        """Refuse a request that could never fit the pool, however long it waited."""
        bm = self.block_manager
        check_fits_pool(num_tokens, max_tokens, self.max_model_len, bm.block_size, bm.num_blocks, what)

    def add_request(self, request: Request) -> None:
        """Queue a request."""
        self._accept(request)
        self.scheduler.add(request)

    def _accept(self, request: Request) -> None:
        """Check a new request and make it live."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not 0 <= request.num_external_tokens < request.num_tokens:
            raise ValueError(f"num_external_tokens must be in [0, {request.num_tokens}) for a request of "
                             f"{request.num_tokens} tokens (the last token is computed to sample the next), "
                             f"got {request.num_external_tokens}")
        self.check_fits(request.num_tokens, request.params.max_tokens)
        self.requests[request.request_id] = request

    def abort_requests(self, request_ids: Iterable[str],
                       reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]:
        """Stop requests now; one final output for each that was live.

        Their blocks are freed, except that a ``hold_kv`` request ended for another ``reason`` than
        an abort (the front end found a stop string) keeps them, as if it had ended here.
        """
        outputs = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            self._forget(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.FINISHED_HOLDING_KV:
                self.scheduler.release_kv(request_id)
                continue
            request.finish(reason)
            self.scheduler.finish(request)
            if request.status is RequestStatus.FINISHED_HOLDING_KV:
                self.requests[request_id] = request  # still live: its K/V may be exported until released
            outputs.append(self._output(request, []))
        if not self.has_unfinished_requests():
            self._run_ended()
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, waiting for K/V, or running."""
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------------------------- step
    def step(self) -> EngineCoreOutputs:
        """Run one scheduling step; report every request that got a token or finished.

        Until the executor has returned, nothing is committed: an error rolls the step back (its
        requests wait again, holding nothing it wrote) and is raised. Once the tokens exist, what fails
        after them (:meth:`_after_tokens`, the statistics) is kept for :meth:`take_failure`, never raised
        instead of them; one not taken is raised by the next step before it does anything.
        """
        self._raise_failure()
        self._before_step()
        start = self.clock()
        recording = bool(self.step_stats.maxlen or self.step_callbacks)
        waited = self.run_delay() if recording and self.run_delay is not None else None
        batch = self.scheduler.schedule()
        try:
            batch = self._with_arrivals(batch)
        except BaseException:
            self.scheduler.rollback(batch)
            raise
        if not batch:
            self._check_progress()
            return EngineCoreOutputs([], start)
        try:
            self._enter_step(batch)
            result = self.executor.execute(batch)
        except BaseException:
            # Nothing this step wrote may be read: its requests go back to waiting, holding no K/V of it.
            self.scheduler.rollback(batch)
            self._leave_step()
            raise
        update = self.scheduler.update(batch, result.sampled, result.tokens, start)
        now = self.clock()
        for request in update.finished:
            if request.status is RequestStatus.FINISHED:
                del self.requests[request.request_id]
        if result.prompt_logprobs:
            for request, _ in batch.entries:  # kept until the first token, which carries them all
                scored = result.prompt_logprobs.get(request.request_id)
                if scored:
                    request.num_prompt_logprobs_done += len(scored)
                    request.pending_prompt_logprobs.extend(scored)
        outputs: list[EngineCoreOutput] = []
        for request, token, token_logprobs in zip(result.sampled, result.tokens, result.logprobs, strict=True):
            scored = request.pending_prompt_logprobs
            if scored:
                request.pending_prompt_logprobs = []
            outputs.append(self._output(request, [token], None if token_logprobs is None else [token_logprobs],
                                        scored or None))
        # The step's tokens exist from here on: nothing below may lose them.
        self._after_tokens(batch)
        if not recording:
            self.num_steps += 1  # (no one would read the record)
        else:
            waited_after = self.run_delay() if waited is not None else None
            cpu_wait = None if waited is None or waited_after is None else max(0.0, waited_after - waited)
            self._record_step(start, now, batch, update, cpu_wait)
        if not self.has_unfinished_requests():
            self._run_ended()
        return EngineCoreOutputs(outputs, now, batch.num_tokens)

    def _record_step(self, start: float, now: float, batch: ScheduledBatch, update: StepUpdate,
                     cpu_wait: float | None = None) -> None:
        try:
            bm, sched = self.block_manager, self.scheduler
            self._record(StepStats(
                start_time=start, duration=now - start, num_prefill_tokens=update.num_prefill_tokens,
                num_decode_tokens=update.num_decode_tokens, num_running=len(sched.running),
                num_waiting=len(sched.waiting), kv_blocks_used=bm.num_used_blocks,
                kv_blocks_free=bm.num_free_blocks, prefix_hit_rate=bm.stats.hit_rate,
                num_preemptions=len(batch.preempted), step=self.num_steps,
                num_waiting_for_kv=len(sched.waiting_for_kv), num_context_tokens=update.num_context_tokens,
                prefill_chunk_sizes=update.prefill_chunk_sizes,
                prefill_chunk_contexts=update.prefill_chunk_contexts, prefix_queried_tokens=bm.stats.queried_tokens,
                prefix_hit_tokens=bm.stats.hit_tokens, cpu_wait=cpu_wait, **self._extra_stats()))
        except Exception as err:
            self._keep_failure(err, "recording the step's statistics failed")

    def _check_progress(self) -> None:
        """An empty step: fine while blocks are held elsewhere, a bug when nothing could ever run."""
        sched = self.scheduler
        if (sched.waiting and not sched.running and not sched.waiting_for_kv
                and self.block_manager.num_used_blocks == 0):
            # Requests are checked to fit the pool on arrival and nothing holds a block, so this is a bug.
            raise RuntimeError("the scheduler could not schedule any of the waiting requests")
        # Otherwise blocks are held outside the running set (K/V kept for a receiver, pinned, or
        # arriving): the waiting requests go on once those are released.

    # ------------------------------------------------------------------------------------- hooks
    def _before_step(self) -> None:
        """Work owed by an earlier step, done before anything is scheduled."""

    def _with_arrivals(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The batch to run, once what arrived (K/V from elsewhere) is in place."""
        return batch

    def _enter_step(self, batch: ScheduledBatch) -> None:
        """Just before the executor runs ``batch``."""

    def _leave_step(self) -> None:
        """The executor raised: undo :meth:`_enter_step`."""

    def _after_tokens(self, batch: ScheduledBatch) -> None:
        """After the step's tokens exist (must keep, not raise, what fails: see :meth:`_keep_failure`)."""

    def _extra_stats(self) -> dict:
        """More fields of this step's :class:`StepStats`."""
        return {}

    def _run_ended(self) -> None:
        """No request is left unfinished."""

    def _forget(self, request_id: str) -> None:
        """A request was aborted: drop what the core keeps for it besides the request."""

    # ------------------------------------------------------------------------------------ errors
    def _keep_failure(self, err: Exception, what: str) -> None:
        logger.error("%s (the step's tokens are kept): %s: %s", what, type(err).__name__, err)
        if self._failure is None:
            self._failure = err

    def take_failure(self) -> Exception | None:
        """The error of the last step's work after its tokens (press, statistics), if any; taking it clears it."""
        failure, self._failure = self._failure, None
        return failure

    def _raise_failure(self) -> None:
        failure = self.take_failure()
        if failure is not None:
            raise failure

    def _record(self, stats: StepStats) -> None:
        self.num_steps += 1
        record_step(stats, self.step_stats, self.step_callbacks)

    @staticmethod
    def _output(request: Request, new_tokens: list[int], new_logprobs: list[dict[int, float]] | None = None,
                new_prompt_logprobs: list[dict[int, float]] | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(request.request_id, new_tokens, request.finish_reason, request.stop_reason,
                                request.num_cached_tokens, request.num_preemptions, request.num_prefill_tokens,
                                request.first_scheduled_time, new_logprobs, new_prompt_logprobs)
