"""The machine's stalls: a real run's steps that took far longer than their work explains, replayed in a simulation.

On a shared machine a process is now and then stopped for tens of milliseconds (other tenants, the host), and
a step that spans such a stop takes that much longer, whatever it computed. A step-time model fitted by least
squares spreads those stops thinly over every step; a simulation then never stops, where the real engine did,
and a queue that built up behind a stop (then drained in fewer, bigger prefill steps) is missing from it.

:func:`find_stalls` takes them out of a run: each step whose time exceeds the model's prediction by more than a
threshold is a stall of that excess, at the step's start. :class:`StallingStepTime` puts them back in a
simulation at the same moments: a simulated step that spans a stall's start lasts that much longer, and one
that starts during a stall waits for its end. :func:`without_stalls` leaves them out of the samples a model is
fitted to (:func:`fit_between_stalls`), so that the replayed stalls are not counted twice.

A replay borrows the stalls of the run it is compared with. :func:`draw_stalls` predicts instead: stalls at the
rate, and of the lengths, that calibration runs had, drawn at random times.

Where the engine measured how long each step waited for a core (:attr:`~minipd.engine.stats.StepStats.cpu_wait`,
the time other processes had the cores), those waits need not be inferred: :func:`replay_run_waits` puts each
one back in the middle of its step, on a model of the steps' time on a core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from minipd.engine.stats import StepStats, StepWork
from minipd.sim.fitted import FittedStepTime, cycle_times, speed_factor, timed_steps

#: A step this much longer than its model's prediction is taken for a stall of the machine (seconds): several
#: times the spread of tiny-py's steps on two cores (a 1-10 ms step varies by about a millisecond), and below
#: the 20-50 ms stops seen on a shared machine.
DEFAULT_THRESHOLD_S = 0.005


@dataclass(frozen=True)
class Stall:
    """A stop of the machine: from ``start`` (seconds from the run's start) for ``duration`` seconds."""

    start: float
    duration: float

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"a stall's duration must be > 0 seconds, got {self.duration!r}")


def _check_threshold(threshold_s: float) -> None:
    if not threshold_s > 0:
        raise ValueError(f"threshold_s must be > 0 seconds, got {threshold_s!r}")


def without_stalls(model: FittedStepTime, samples: Sequence[tuple[StepWork, float]],
                   threshold_s: float = DEFAULT_THRESHOLD_S) -> list[tuple[StepWork, float]]:
    """The measured ``(work, seconds)`` samples less those ``threshold_s`` or more longer than ``model`` predicts
    (to fit a model of the machine when it runs, its stalls replayed apart)."""
    _check_threshold(threshold_s)
    return [(w, t) for w, t in samples if t - model.step_time(w) < threshold_s]


def find_stalls(model: FittedStepTime, steps: Sequence[StepStats], origin: float,
                threshold_s: float = DEFAULT_THRESHOLD_S) -> list[Stall]:
    """The stalls in one engine's (or one worker's) steps, in order: each step that took ``threshold_s`` or more
    longer than ``model`` predicts (timed as :func:`~minipd.sim.fitted.cycle_times` counts) is a stall of its
    excess, starting when the step started, in seconds from ``origin`` (``time.perf_counter()`` at the run's
    start, :attr:`~minipd.sim.validate.RealRun.start`)."""
    _check_threshold(threshold_s)
    steps = list(steps)
    stalls = []
    for step, seconds in zip(steps, cycle_times(steps), strict=True):
        excess = seconds - model.step_time(step.work)
        if step.work.num_tokens > 0 and excess >= threshold_s:
            stalls.append(Stall(step.start_time - origin, excess))
    return stalls


class StallingStepTime:
    """A step-time model with a run's stalls put back at their times: a step spanning a stall's start lasts the
    stall longer; a step starting during a stall lasts the rest of it longer (the process was stopped when it
    would have started). A stall the instance slept through costs nothing. The simulation gives it its clock
    (:meth:`bind`); one instance per object (each simulation starts the stalls over)."""

    def __init__(self, model: FittedStepTime, stalls: Sequence[Stall]) -> None:
        self.model = model
        self.stalls = sorted(stalls, key=lambda s: s.start)
        self._next = 0
        self._clock: Callable[[], float] | None = None
        #: Seconds the simulated steps were made longer by stalls (in the last simulation).
        self.stalled_time = 0.0

    def bind(self, clock: Callable[[], float]) -> None:
        """Use ``clock()`` (the simulation's time); the stalls start over."""
        self._clock, self._next, self.stalled_time = clock, 0, 0.0

    def step_time(self, work: StepWork) -> float:
        if self._clock is None:
            raise RuntimeError("StallingStepTime needs the simulation's clock: run it through simulate()")
        now = self._clock()
        end = now + self.model.step_time(work)
        while self._next < len(self.stalls):
            stall = self.stalls[self._next]
            if stall.start >= end:
                break
            self._next += 1
            # (A stall over before the step began passed while the instance slept.)
            added = max(0.0, stall.start + stall.duration - max(now, stall.start))
            end += added
            self.stalled_time += added
        return end - now


@dataclass(frozen=True)
class RunStalls:
    """What :func:`replay_run_stalls` found in a run: its speed between stalls (measured step time over the
    model's, 1.0: as fitted), how many stalls and how long they lasted in all (seconds)."""

    factor: float
    stalls: int
    stalled_s: float


def fit_between_stalls(model: FittedStepTime, calibration: Sequence[tuple[StepWork, float]],
                       threshold_s: float = DEFAULT_THRESHOLD_S) -> FittedStepTime:
    """``model`` fitted again (same ranges) on the ``calibration`` samples it was fitted on, less their stalls:
    the machine when it runs, for :func:`replay_run_stalls` to put each run's own stalls back on."""
    return FittedStepTime.fit(without_stalls(model, calibration, threshold_s), model.splits, source=model.source)


def replay_run_stalls(between: FittedStepTime, steps: Sequence[StepStats], origin: float,
                      threshold_s: float = DEFAULT_THRESHOLD_S) -> tuple[StallingStepTime, RunStalls]:
    """A step model to simulate one real run of ``steps`` with: ``between`` (a model of the machine between its
    stalls, :func:`fit_between_stalls`) at the speed this run's steps between stalls ran
    (:func:`~minipd.sim.fitted.speed_factor`), with this run's own stalls put back at their times."""
    factor = speed_factor(between, without_stalls(between, timed_steps(steps), threshold_s))
    at_speed = between.scaled(factor)
    stalls = find_stalls(at_speed, steps, origin, threshold_s)
    return StallingStepTime(at_speed, stalls), RunStalls(factor, len(stalls), sum(s.duration for s in stalls))


def replay_run_waits(on_core: FittedStepTime, steps: Sequence[StepStats], origin: float
                     ) -> tuple[StallingStepTime, RunStalls]:
    """A step model to simulate one real run of ``steps`` with, from the waits for a core the engine measured:
    ``on_core`` (a model of the steps' time on a core, fitted to ``timed_steps(..., on_core=True)`` of calibration
    runs) at the speed this run's steps ran on a core, with each step's wait put back as a stall in the middle of
    the step (seconds from ``origin``): the process was off its core then, whatever it computed. (A wait is many
    small ones spread over its step; the middle keeps a simulated step that starts a little earlier or later than
    the real one paying all of it.) A ValueError if a step has no measured wait."""
    steps = list(steps)
    factor = speed_factor(on_core, timed_steps(steps, on_core=True))
    stalls = [Stall(s.start_time - origin + (s.duration - s.cpu_wait) / 2, s.cpu_wait) for s in steps if s.cpu_wait]
    return StallingStepTime(on_core.scaled(factor), stalls), RunStalls(factor, len(stalls),
                                                                        sum(x.duration for x in stalls))


def draw_stalls(found: Sequence[Stall], span_s: float, horizon_s: float, seed: int = 0) -> list[Stall]:
    """Stalls like ``found`` (those of calibration runs lasting ``span_s`` seconds in all), at random: a Poisson
    process at their rate over ``horizon_s`` seconds from 0, each lasting the length of one of them drawn at
    random, seeded (the same stalls for the same seed). None found: none drawn."""
    if not span_s > 0 or not horizon_s >= 0:
        raise ValueError(f"span_s must be > 0 and horizon_s >= 0 seconds, got {span_s!r} and {horizon_s!r}")
    if not found:
        return []
    rng = np.random.default_rng(seed)
    rate = len(found) / span_s
    lengths = [s.duration for s in found]
    stalls, now = [], 0.0
    while True:
        now += float(rng.exponential(1.0 / rate))
        if now > horizon_s:
            return stalls
        stalls.append(Stall(now, lengths[int(rng.integers(len(lengths)))]))


__all__ = ["DEFAULT_THRESHOLD_S", "RunStalls", "Stall", "StallingStepTime", "draw_stalls", "find_stalls",
           "fit_between_stalls", "replay_run_stalls", "replay_run_waits", "without_stalls"]
