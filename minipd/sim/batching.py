"""Static, dynamic and continuous batching, run on minipd's engine and recorded step by step.

minipd's engine batches *continuously*: every step, finished requests leave and waiting ones join.
The older schemes are easy to imitate on top of it, by holding requests back:

- **static** batching takes ``batch_size`` requests, runs them until the *longest* one is done,
  and only then starts the next batch. Members that finish early leave a slot idle (in a real
  padded implementation the slot keeps computing padding);
- **dynamic** batching is static batching whose batches are formed from a queue: a batch starts
  once ``batch_size`` requests wait or the oldest has waited ``max_wait`` steps, whichever comes first;
- **continuous** batching hands every request to the engine the moment it arrives.

Time is counted in engine steps. Requests arrive at given steps (all at step 0 by default); a step
in which nothing runs is recorded as an empty step. Each run returns a :class:`Timeline`: for every
step and every request, its *phase* and how many of its tokens were computed, read from the
requests themselves before and after :meth:`Engine.step <minipd.engine.engine.Engine.step>`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from minipd.engine.inputs import PromptInput
from minipd.engine.output_processor import RequestState
from minipd.engine.request import RequestStatus
from minipd.engine.stats import StepStats
from minipd.outputs import RequestOutput
from minipd.sampling_params import SamplingParams

#: What a request can be doing in one step, in the order of its life.
#: ``""``: not arrived yet; ``queued``: arrived, holds no KV blocks; ``prefill``: prompt tokens (or,
#: after a preemption, prompt and output tokens) computed; ``decode``: one new token computed;
#: ``stalled``: running (holds KV blocks) but got no tokens this step; ``preempted``: lost its KV
#: blocks this step; ``idle``: finished, but its static batch is still running (a wasted slot);
#: ``done``: finished.
PHASES = ("", "queued", "prefill", "decode", "stalled", "preempted", "idle", "done")

#: One character per phase for :meth:`Timeline.render`.
PHASE_CHARS = {"": " ", "queued": ".", "prefill": "P", "decode": "d", "stalled": "s", "preempted": "X",
               "idle": "_", "done": " "}


@dataclass(frozen=True)
class StepRecord:
    """One step of the clock: when it ran and, per request label, its phase and tokens computed."""

    index: int
    start: float
    duration: float
    #: Phase of every request that has arrived (label such as ``"r0"`` -> one of :data:`PHASES`).
    phases: dict[str, str]
    #: Tokens whose K/V this step made available, for the requests that got any (a prefix-cache
    #: hit counts its cached tokens here too).
    tokens: dict[str, int]
    #: Requests that received an output token at the end of this step.
    emitted: frozenset[str] = frozenset()


@dataclass(frozen=True)
class LoadPoint:
    """One run summarised: output tokens per second, and mean TTFT and TPOT in seconds."""

    label: str
    throughput: float
    mean_ttft: float
    mean_tpot: float


@dataclass
class Timeline:
    """What a batching run did, step by step, and what each request got back.

    ``labels[i]`` (``"r0"``, ``"r1"``, ...), ``request_ids[i]`` (the engine's id), ``arrivals[i]``
    and ``outputs[i]`` belong to the i-th prompt given to the run.
    """

    scheme: str
    labels: list[str]
    request_ids: list[str]
    arrivals: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    #: The engine's own records of the steps that ran (empty steps have none).
    step_stats: list[StepStats] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        """Steps from the first arrival until the last request finished, empty ones included."""
        return len(self.steps)

    @property
    def seconds(self) -> float:
        """Wall time spent in steps."""
        return sum(s.duration for s in self.steps)

    def phase_rows(self) -> list[list[str]]:
        """One row per request, one phase per step."""
        return [[s.phases.get(label, "") for s in self.steps] for label in self.labels]

    def token_rows(self) -> list[list[int]]:
        """One row per request: tokens computed at each step (0 when none)."""
        return [[s.tokens.get(label, 0) for s in self.steps] for label in self.labels]

    def count(self, phase: str) -> int:
        """How many (request, step) cells are in ``phase``: e.g. ``count("idle")`` is wasted slot-steps."""
        return sum(row.count(phase) for row in self.phase_rows())

    def first_token_steps(self) -> list[int]:
        """For each request, the step that produced its first token."""
        return [next(s.index for s in self.steps if label in s.emitted) for label in self.labels]

    def finish_steps(self) -> list[int]:
        """For each request, the step that produced its last token."""
        return [next(s.index for s in reversed(self.steps) if label in s.emitted) for label in self.labels]

    def ttft_steps(self) -> list[int]:
        """Steps from arrival to first token, counting the step that produced it (1 = no waiting at all)."""
        return [f - a + 1 for f, a in zip(self.first_token_steps(), self.arrivals, strict=True)]

    def summary(self, label: str | None = None) -> LoadPoint:
        """Throughput (output tokens per second of step time) and mean TTFT and TPOT (seconds)."""
        tokens = sum(len(o.token_ids) for o in self.outputs)
        ttfts = [o.metrics.ttft for o in self.outputs if o.metrics.ttft is not None]
        tpots = [o.metrics.tpot for o in self.outputs if o.metrics.tpot is not None]
        return LoadPoint(label if label is not None else self.scheme, tokens / self.seconds if self.seconds else 0.0,
                         statistics.fmean(ttfts) if ttfts else float("nan"),
                         statistics.fmean(tpots) if tpots else float("nan"))

    def render(self, max_steps: int = 100) -> str:
        """The timeline as text, one row per request and one character per step.

        ``.`` queued, ``P`` prefill, ``d`` decode, ``s`` stalled, ``X`` preempted, ``_`` idle slot,
        blank before arrival and after finishing. A ruler marks every tenth step.
        """
        width = min(self.num_steps, max_steps)
        pad = max(len(label) for label in self.labels) + 1
        ruler = "".join(str(i // 10 % 10) if i % 10 == 0 else " " for i in range(width))
        lines = [" " * pad + ruler]
        for label, row in zip(self.labels, self.phase_rows(), strict=True):
            text = "".join(PHASE_CHARS[p] for p in row[:width]).rstrip()
            lines.append(f"{label:<{pad}}{text}")
        if self.num_steps > width:
            lines.append(f"... {self.num_steps - width} more steps")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ runs


class _Recorder:
    """Adds requests to an engine at their arrival steps, steps it, and records every step."""

    def __init__(self, llm, prompts: Sequence[PromptInput], params: SamplingParams | Sequence[SamplingParams],
                 arrivals: Sequence[int] | None, scheme: str) -> None:
        n = len(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * n
        if len(params) != n:
            raise ValueError(f"got {n} prompts but {len(params)} SamplingParams")
        arrivals = [0] * n if arrivals is None else list(arrivals)
        if len(arrivals) != n or any(not isinstance(a, int) or a < 0 for a in arrivals):
            raise ValueError(f"arrivals must be {n} step numbers >= 0, got {arrivals}")
        self.engine = llm.engine
        self.params = list(params)
        self.prompts = list(prompts)
        self.requests: list[RequestState | None] = [None] * n
        self.stats_start = self.engine.core.num_steps
        self.timeline = Timeline(scheme, [f"r{i}" for i in range(n)], [""] * n, arrivals)
        # Wall-clock arrival of each request, so TTFT includes time queued before the engine saw it.
        self.arrival_times: list[float | None] = [None] * n

    def arrived(self, clock: int) -> list[int]:
        """Requests that have arrived by ``clock``; the new ones get their arrival time stamped now."""
        now = time.perf_counter()
        for i, a in enumerate(self.timeline.arrivals):
            if a <= clock and self.arrival_times[i] is None:
                self.arrival_times[i] = now
        return [i for i, a in enumerate(self.timeline.arrivals) if a <= clock]

    def submit(self, i: int) -> None:
        request = self.engine.make_request(self.prompts[i], self.params[i], index=i,
                                           arrival_time=self.arrival_times[i])
        self.requests[i] = request
        self.timeline.request_ids[i] = request.request_id
        self.engine.add(request)

    def finished(self, i: int) -> bool:
        request = self.requests[i]
        return request is not None and request.finish_reason is not None

    def all_finished(self) -> bool:
        return all(self.finished(i) for i in range(len(self.requests)))

    def step(self, clock: int, batch: set[int] | None = None) -> None:
        """Run one engine step (or an empty one) and record every arrived request's phase in it.

        ``batch``: the static batch now running, whose finished members count as idle slots.
        """
        before = {}
        for i, state in enumerate(self.requests):
            if state is not None:
                r = state.request
                before[i] = (r.num_computed_tokens, r.num_output_tokens, r.num_preemptions, r.status,
                             state.finished, r.is_decode(1))
        start = time.perf_counter()
        ran = self.engine.has_unfinished_requests()
        if ran:
            self.engine.step()
        duration = time.perf_counter() - start if ran else 0.0
        phases: dict[str, str] = {}
        tokens: dict[str, int] = {}
        emitted: set[str] = set()
        for i in self.arrived(clock):
            state = self.requests[i]
            key = self.timeline.labels[i]
            if state is None:
                phases[key] = "queued"
                continue
            r = state.request
            computed, num_out, preemptions, status, was_finished, next_is_decode = before[i]
            delta = r.num_computed_tokens - computed
            if was_finished:
                phases[key] = "idle" if batch is not None and i in batch else "done"
            elif r.num_preemptions > preemptions:
                phases[key] = "preempted"
            elif delta > 0:
                tokens[key] = delta
                # The engine's own rule (Request.is_decode), asked before the step ran.
                phases[key] = "decode" if delta == 1 and next_is_decode else "prefill"
            elif status is RequestStatus.RUNNING:
                phases[key] = "stalled"
            else:
                phases[key] = "queued"
            if r.num_output_tokens > num_out:
                emitted.add(key)
        self.timeline.steps.append(StepRecord(clock, start, duration, phases, tokens, frozenset(emitted)))

    def finish(self) -> Timeline:
        tl = self.timeline
        tl.outputs = [r.to_output() for r in self.requests if r is not None]
        tl.step_stats = [s for s in self.engine.step_stats if s.step >= self.stats_start]
        return tl

    def abort_all(self) -> None:
        for r in self.requests:
            if r is not None and r.finish_reason is None:
                self.engine.abort(r.request_id)


def _check_idle(llm) -> None:
    if llm.engine.has_unfinished_requests():
        raise ValueError("the engine still has unfinished requests; finish or abort them before a batching run")


def run_continuous(llm, prompts: Sequence[PromptInput], params: SamplingParams | Sequence[SamplingParams],
                   arrivals: Sequence[int] | None = None, max_steps: int = 100_000) -> Timeline:
    """Continuous batching: each request goes to the engine at its arrival step.

    How many requests run at once and how many tokens a step computes are the engine's settings
    (``LLM(..., max_num_seqs=..., max_num_batched_tokens=...)``).
    """
    _check_idle(llm)
    rec = _Recorder(llm, prompts, params, arrivals, "continuous")
    try:
        for clock in range(max_steps):
            for i in rec.arrived(clock):
                if rec.requests[i] is None:
                    rec.submit(i)
            rec.step(clock)
            if rec.all_finished():
                return rec.finish()
        raise RuntimeError(f"not finished after {max_steps} steps")
    finally:
        rec.abort_all()


def run_batched(llm, prompts: Sequence[PromptInput], params: SamplingParams | Sequence[SamplingParams],
                batch_size: int, arrivals: Sequence[int] | None = None, max_wait: int | None = None,
                max_steps: int = 100_000) -> Timeline:
    """Static (``max_wait=None``) or dynamic batching of requests, one batch at a time, on the engine.

    When no batch is running, a new one of up to ``batch_size`` queued requests (oldest first)
    starts if ``batch_size`` are queued, or if the oldest has waited ``max_wait`` steps, or if no
    more requests will arrive. It then runs until its last member finishes; nothing joins it.
    The engine must allow ``batch_size`` running requests (``max_num_seqs``).

    The engine skips finished members instead of computing padding for them, so step counts and
    idle slots are faithful but wall-clock times flatter static and dynamic batching.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_wait is not None and max_wait < 0:
        raise ValueError(f"max_wait must be None or >= 0 steps, got {max_wait}")
    if batch_size > llm.engine.scheduler.max_num_seqs:
        raise ValueError(f"batch_size {batch_size} is larger than the engine's max_num_seqs "
                         f"{llm.engine.scheduler.max_num_seqs}")
    _check_idle(llm)
    rec = _Recorder(llm, prompts, params, arrivals, "static" if max_wait is None else "dynamic")
    n = len(prompts)
    batch: set[int] = set()
    try:
        for clock in range(max_steps):
            if batch and all(rec.finished(i) for i in batch):
                batch = set()
            if not batch:
                queue = [i for i in sorted(range(n), key=lambda i: (rec.timeline.arrivals[i], i))
                         if rec.timeline.arrivals[i] <= clock and rec.requests[i] is None]
                more_coming = any(a > clock for a in rec.timeline.arrivals)
                oldest_wait = clock - rec.timeline.arrivals[queue[0]] if queue else 0
                if queue and (len(queue) >= batch_size or not more_coming
                              or (max_wait is not None and oldest_wait >= max_wait)):
                    batch = set(queue[:batch_size])
                    for i in sorted(batch):
                        rec.submit(i)
            rec.step(clock, batch)
            if rec.all_finished():
                return rec.finish()
        raise RuntimeError(f"not finished after {max_steps} steps")
    finally:
        rec.abort_all()


def run_static(llm, prompts: Sequence[PromptInput], params: SamplingParams | Sequence[SamplingParams],
               batch_size: int, arrivals: Sequence[int] | None = None) -> Timeline:
    """Static batching: batches of ``batch_size`` that start full and run until their longest member is done."""
    return run_batched(llm, prompts, params, batch_size, arrivals, max_wait=None)


def run_dynamic(llm, prompts: Sequence[PromptInput], params: SamplingParams | Sequence[SamplingParams],
                batch_size: int, max_wait: int, arrivals: Sequence[int] | None = None) -> Timeline:
    """Dynamic batching: a batch starts when ``batch_size`` requests wait or the oldest has waited ``max_wait``."""
    return run_batched(llm, prompts, params, batch_size, arrivals, max_wait=max_wait)


def exact_params(output_lens: Sequence[int]) -> list[SamplingParams]:
    """Greedy parameters that make request i produce exactly ``output_lens[i]`` tokens."""
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
