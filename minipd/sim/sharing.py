"""Instances that share one machine's cores: each one's steps run slower while another instance computes.

On a GPU fleet every instance owns its devices, and a step takes the time its work takes. On this machine a
disaggregated engine's prefill and decode workers are two processes on the same two cores (and the same caches
and memory bus): a prefill step that runs beside a decode step takes longer than one that runs alone. A step
model fitted to such a run learns the *average* slowdown of the load it was fitted on; it comes out too slow at
light load (steps mostly alone) and too fast under heavy load (steps mostly side by side), which is where
prefill queues build up.

The model here is processor sharing with a slowdown per instance: an instance with ``slowdown`` σ computes at
``1 / (1 + σ·k)`` of its own speed while ``k`` other instances of the cluster are mid-step, so a step of ``W``
seconds alone that overlaps others for ``o`` of its seconds lasts ``d = W + o·σ/(1 + σ)`` (with one other).

- :class:`SharedCores` is the simulation's side: every step of every instance goes through it, and the end of
  each step moves whenever another one starts or ends.
- :func:`step_overlaps` measures, from a real run's step records, how long each step of a worker overlapped the
  other workers' steps; :func:`fit_shared` fits a step model (the time alone) and σ to the measured steps.

Measured on two shared cores (``scripts/validate_simulator.py``, README): it predicts single prefill steps better
than a per-worker fit, but simulated queues came out longer than the engine's under load: the cores are shared with
the front end and the rest of the machine too, so what one run fits as "the other worker" is not what the next
one meets. An option to study, not the validation's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipd.engine.stats import StepStats, StepWork
from minipd.sim.fitted import FittedStepTime, cycle_times

#: The fitted share of an overlapped second a step loses is kept below this (σ ≤ 19): a share near 1 would
#: mean a step makes no progress at all beside another.
_MAX_SHARE_LOST = 0.95


@dataclass
class _Step:
    remaining: float  # seconds of work left, at the instance's own speed
    slowdown: float
    done: Any  # the simpy event that ends the step


class SharedCores:
    """The cores a cluster's instances share, inside a simpy environment: :meth:`run` a step of ``seconds``
    (its time alone) and wait for the event it returns, which fires once the step's work is done at the speeds
    the other instances' steps left it."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._steps: dict[str, _Step] = {}
        self._since = 0.0  # when the remaining work was last brought up to date
        self._generation = 0  # the wake-up scheduled last (earlier ones are stale)

    def _rate(self, step: _Step) -> float:
        return 1.0 / (1.0 + step.slowdown * (len(self._steps) - 1))

    def _advance(self) -> None:
        elapsed = self.env.now - self._since
        if elapsed > 0:
            for step in self._steps.values():
                step.remaining -= elapsed * self._rate(step)
        self._since = self.env.now

    def _schedule(self) -> None:
        self._generation += 1
        if not self._steps:
            return
        name, first = min(self._steps.items(), key=lambda item: item[1].remaining / self._rate(item[1]))
        wake = self.env.timeout(max(0.0, first.remaining / self._rate(first)))
        generation = self._generation
        wake.callbacks.append(lambda _event: self._wake(generation, name))

    def _wake(self, generation: int, name: str) -> None:
        if generation != self._generation:
            return  # a step started or ended since: a later wake-up was scheduled
        self._advance()
        for other, step in list(self._steps.items()):
            # The step the wake-up was for ends now; any other whose work ran out to rounding, with it.
            if other == name or step.remaining <= 1e-12:
                del self._steps[other]
                step.done.succeed()
        self._schedule()

    def run(self, name: str, seconds: float, slowdown: float) -> Any:
        """Start instance ``name``'s step of ``seconds`` alone, slowed by ``slowdown`` per other instance
        mid-step; returns the event fired when it ends. One step per instance at a time."""
        if name in self._steps:
            raise RuntimeError(f"{name} started a step before its previous one ended")
        self._advance()
        done = self.env.event()
        self._steps[name] = _Step(seconds, slowdown, done)
        self._schedule()
        return done


def _intervals(steps: Sequence[StepStats]) -> list[tuple[float, float]]:
    """Each step's span as the simulator counts it: from its start for its cycle time (:func:`cycle_times`)."""
    return [(s.start_time, s.start_time + t) for s, t in zip(steps, cycle_times(steps), strict=True)]


def step_overlaps(steps: Sequence[StepStats], others: Sequence[Sequence[StepStats]]) -> list[float]:
    """Seconds of each of ``steps`` (one worker's, in order) during which at least one of the ``others``
    (every other worker's steps, each list in order, on the same clock) was mid-step."""
    busy = sorted(span for worker in others for span in _intervals(worker))
    merged: list[list[float]] = []
    for start, end in busy:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = np.array([m[0] for m in merged])
    overlaps = []
    for start, end in _intervals(steps):
        first = max(0, int(np.searchsorted(starts, start, side="right")) - 1)
        total = 0.0
        for low, high in merged[first:]:
            if low >= end:
                break
            total += max(0.0, min(end, high) - max(start, low))
        overlaps.append(total)
    return overlaps


def fit_shared(samples: Sequence[tuple[StepWork, float]], overlaps: Sequence[float], splits: Sequence[int] = (),
               source: str = "", tolerance: float = 1e-4) -> tuple[FittedStepTime, float]:
    """A step model of the time alone and the slowdown σ (see the module's doc), fitted to measured steps
    ``(work, seconds)`` and the seconds each overlapped other instances' steps (:func:`step_overlaps`).

    Least squares of ``seconds ≈ model(work) + share · overlap`` with ``share = σ / (1 + σ)``: for a given share
    the model is a :meth:`FittedStepTime.fit` to the times less the overlap's share, and the share is the one
    whose fit leaves the least squared error, found by golden-section search to ``tolerance`` (the error is
    convex in it). Steps without tokens or time are left out, as :meth:`FittedStepTime.fit` leaves them.
    """
    if len(samples) != len(overlaps):
        raise ValueError(f"need one overlap per sample, got {len(overlaps)} for {len(samples)}")
    kept = [(w, t, o) for (w, t), o in zip(samples, overlaps, strict=True) if w.num_tokens > 0 and t > 0]
    if not kept:
        raise ValueError("no measured step to fit (steps with tokens and a duration)")
    works = [w for w, _, _ in kept]
    seconds = np.array([t for _, t, _ in kept])
    # (A step overlaps others for at most its own length, so the times less a share < 1 of it stay positive.)
    overlap = np.minimum(np.array([o for _, _, o in kept]), seconds)

    def fit_at(share: float) -> tuple[float, FittedStepTime]:
        alone = seconds - share * overlap
        model = FittedStepTime.fit(list(zip(works, alone.tolist(), strict=True)), splits, source)
        predicted = np.array([model.step_time(w) for w in works]) + share * overlap
        return float(((seconds - predicted) ** 2).sum()), model

    if not overlap.any():
        return fit_at(0.0)[1], 0.0
    golden = (np.sqrt(5.0) - 1.0) / 2.0
    low, high = 0.0, _MAX_SHARE_LOST
    inner_low, inner_high = high - golden * (high - low), low + golden * (high - low)
    error_low, error_high = fit_at(inner_low)[0], fit_at(inner_high)[0]
    while high - low > tolerance:
        if error_low <= error_high:
            high, inner_high, error_high = inner_high, inner_low, error_low
            inner_low = high - golden * (high - low)
            error_low = fit_at(inner_low)[0]
        else:
            low, inner_low, error_low = inner_low, inner_high, error_high
            inner_high = low + golden * (high - low)
            error_high = fit_at(inner_high)[0]
    # The bracket's ends are candidates too (the best share may be 0: no slowdown at all).
    _, share = min((fit_at(x)[0], x) for x in ((low + high) / 2, 0.0, _MAX_SHARE_LOST))
    return fit_at(share)[1], share / (1.0 - share)


def shared_errors(model: FittedStepTime, slowdown: float, samples: Sequence[tuple[StepWork, float]],
                  overlaps: Sequence[float]) -> np.ndarray:
    """Relative error of each measured step's predicted time, the overlap it had counted in (steps without tokens
    or time left out)."""
    share = slowdown / (1.0 + slowdown)
    return np.array([(model.step_time(w) + share * o) / t - 1.0 for (w, t), o in zip(samples, overlaps, strict=True)
                     if w.num_tokens > 0 and t > 0])


__all__ = ["SharedCores", "fit_shared", "shared_errors", "step_overlaps"]
