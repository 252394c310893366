"""One simulated engine instance: minipd's own scheduler and block manager, a step-time model, no model.

The instance is a real :class:`~minipd.engine.step_core.StepCore`, the loop the engine runs, with the
real :class:`~minipd.engine.scheduler.Scheduler` and :class:`~minipd.kv.block_manager.BlockManager`. Only
two things are stand-ins: the *executor* computes no tokens but asks a step-time model how long the
batch would take (and samples a fixed token for every row that reaches its sequence's end), and the
*clock* is the simulation's. So chunked prefill, the token budget, ``max_num_seqs``, preemption when
the KV pool runs out, and the waiting-for-KV state of a disaggregated decode are the engine's, not a
re-implementation of them.

A step is taken whole at its start (the scheduler's decisions, the requests' bookkeeping) and its
tokens are delivered when its simulated duration has passed, as in the engine, where a request that
arrives during a step joins at the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from minipd.engine.request import EngineCoreOutputs, Request
from minipd.engine.scheduler import ScheduledBatch, Scheduler
from minipd.engine.stats import StepWork
from minipd.engine.step_core import StepCore, StepResult
from minipd.kv.block_manager import BlockManager

#: The token every simulated row samples: requests run with ``ignore_eos`` and end by length.
SIM_TOKEN = 0

ROLES = ("colocated", "prefill", "decode")


class StepTimeModel(Protocol):
    """How long a step takes: :class:`~minipd.sim.fitted.FittedStepTime` (measured on this machine),
    :class:`~minipd.sim.roofline.RooflineStepTime` (a GPU from its datasheet), or any callable wrapper."""

    def step_time(self, work: StepWork) -> float: ...


class TimedExecutor:
    """The executor of a simulated core: the step's duration from a model, a fixed token per sampling row."""

    def __init__(self, model: StepTimeModel) -> None:
        self.model = model
        #: The duration of the step being taken (0 outside a step: the clock adds it to the step's end).
        self.pending = 0.0
        self.last_work = StepWork()

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.last_work = StepWork.from_entries(batch.entries)
        self.pending = self.model.step_time(self.last_work)
        # (Request.samples_after, inline: once per row of every simulated step)
        sampled = [r for r, n in batch.entries if r.num_computed_tokens + n == len(r.all_token_ids)]
        return StepResult(sampled, [SIM_TOKEN] * len(sampled), [None] * len(sampled), {})


@dataclass
class InstanceConfig:
    """An instance's engine settings, as :class:`~minipd.engine.config.EngineConfig` names them."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "decode-first"
    max_model_len: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class InstanceStats:
    """What an instance did over a run."""

    busy_time: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    #: (start, duration, prefill tokens, decode rows) of every step, when the instance keeps a timeline.
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)


class SimInstance:
    """An engine instance inside a :mod:`simpy` environment.

    Args:
        env: the simulation's environment (its ``now`` is the instance's clock).
        name: for reports (``"prefill0"``).
        role: ``"colocated"`` (prefill and decode), ``"prefill"`` or ``"decode"``; the cluster decides what
            each role is given, the instance runs whatever requests it gets.
        model: the step-time model.
        config: the engine settings.
        on_outputs: called with each step's outputs once its duration has passed.
        on_waiting_for_kv: called with each request that the scheduler admitted to wait for its K/V
            (blocks allocated, nothing computed): the cluster starts its transfer then.
        keep_timeline: record every step (for plots).
        shared: the cores this instance shares with the cluster's others (:class:`~minipd.sim.sharing.SharedCores`),
            or None when its steps take the time the model gives.
        sharing_slowdown: with ``shared``, how much slower it computes per other instance mid-step.
    """

    def __init__(self, env: Any, name: str, role: str, model: StepTimeModel, config: InstanceConfig,
                 on_outputs: Callable[[SimInstance, EngineCoreOutputs], None],
                 on_waiting_for_kv: Callable[[SimInstance, Request], None] | None = None,
                 keep_timeline: bool = False, shared: Any = None, sharing_slowdown: float = 0.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.env, self.name, self.role, self.config = env, name, role, config
        self.executor = TimedExecutor(model)
        blocks = BlockManager(config.num_kv_blocks, config.block_size, enable_prefix_caching=False)
        scheduler = Scheduler(blocks, config.max_num_batched_tokens, config.max_num_seqs, config.scheduling_policy)
        self.core = StepCore(scheduler, self.executor, config.max_model_len, clock=self._now, stats_history=0)
        self.on_outputs, self.on_waiting_for_kv = on_outputs, on_waiting_for_kv
        self.keep_timeline = keep_timeline
        self.shared, self.sharing_slowdown = shared, sharing_slowdown
        self.stats = InstanceStats()
        #: How long the last step took (a layer-wise transfer hides behind the prefill's last step).
        self.last_step_duration = 0.0
        self._wake: Any = None
        self._poked = False  # poked since the step began (by a callback of the step itself, say)
        self._announced: set[str] = set()
        # Bumped by every change to the queue or the pool, so that free_blocks (asked by the router for every
        # request it places, while queues can be thousands long) is summed once per change.
        self._version = 0
        self._free_blocks_cache = (-1, 0)
        self.process = env.process(self._run())

    def _now(self) -> float:
        return self.env.now + self.executor.pending

    # ----------------------------------------------------------------------------- requests
    def add(self, request: Request) -> None:
        """Queue a request (it must fit the pool: :meth:`StepCore.check_fits` raises otherwise)."""
        self.core.add_request(request)
        self._version += 1
        self.poke()

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_kv`` request kept (its K/V were read)."""
        self.core.abort_requests([request_id])
        self._version += 1
        self.poke()

    def kv_arrived(self, request_id: str) -> None:
        """The K/V a request waited for are in its blocks: it may compute."""
        self._announced.discard(request_id)
        self.core.scheduler.kv_arrived(request_id)
        self._version += 1
        self.poke()

    def poke(self) -> None:
        """Something changed (a request, freed blocks, arrived K/V): an idle instance looks again."""
        self._poked = True
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # ------------------------------------------------------------------------------ load
    @property
    def num_requests(self) -> int:
        """Requests waiting, waiting for K/V or running (not those only holding K/V for a reader)."""
        sched = self.core.scheduler
        return len(sched.waiting) + len(sched.running) + len(sched.waiting_for_kv)

    @property
    def free_blocks(self) -> int:
        """Free KV blocks less those the requests queued here will take when admitted (as the real cluster
        counts blocks promised to requests on their way to a worker)."""
        version, free = self._free_blocks_cache
        if version != self._version:
            bm = self.core.block_manager
            promised = sum(-(-r.num_tokens // bm.block_size) for r in self.core.scheduler.waiting
                           if not r.blocks.block_table)
            free = bm.num_free_blocks - promised
            self._free_blocks_cache = (self._version, free)
        return free

    # ------------------------------------------------------------------------------ loop
    def _run(self) -> Iterator[Any]:
        core, executor = self.core, self.executor
        while True:
            if not core.has_unfinished_requests():
                self._wake = self.env.event()
                yield self._wake
                continue
            start = self.env.now
            self._poked = False
            outputs = core.step()
            self._version += 1
            duration, executor.pending = executor.pending, 0.0
            self._announce_waiting()
            if not outputs.num_scheduled_tokens:
                # Nothing could run (every request waits for K/V, or for blocks held for a reader), unless the
                # announcements just now gave it something (their poke found no sleeper to wake): look again.
                if self._poked:
                    continue
                self._wake = self.env.event()
                yield self._wake
                continue
            if self.shared is None:
                self._count_step(start, duration)
                yield self.env.timeout(duration)
            else:  # (it lasts as long as the others' steps beside it let it: counted once it has ended)
                yield self.shared.run(self.name, duration, self.sharing_slowdown)
                duration = self.env.now - start
                self._count_step(start, duration)
            self.last_step_duration = duration
            self.on_outputs(self, outputs)

    def _count_step(self, start: float, duration: float) -> None:
        work, stats = self.executor.last_work, self.stats
        stats.busy_time += duration
        stats.steps += 1
        stats.prefill_tokens += work.prefill_tokens
        stats.decode_tokens += work.decode_rows
        if self.keep_timeline:
            stats.timeline.append((start, duration, work.prefill_tokens, work.decode_rows))

    def _announce_waiting(self) -> None:
        if self.on_waiting_for_kv is None:
            return
        waiting = self.core.scheduler.waiting_for_kv
        for request_id, request in list(waiting.items()):  # (a callback may release one: a copy)
            if request_id not in self._announced and request_id in waiting:
                self._announced.add(request_id)
                self.on_waiting_for_kv(self, request)

    def finish_stats(self) -> None:
        """Copy counters kept elsewhere into :attr:`stats` (at the end of a run)."""
        self.stats.preemptions = self.core.scheduler.num_preemptions


__all__ = ["ROLES", "SIM_TOKEN", "InstanceConfig", "InstanceStats", "SimInstance", "StepTimeModel", "TimedExecutor"]
