"""A step-time model fitted to the steps an engine really took on this machine.

A step's time is modelled as linear in what it computed (:class:`~minipd.engine.stats.StepWork`): a fixed
cost, prompt tokens, the (query, key) pairs prefill attention visited, decode rows and the keys they
read, with non-negative coefficients (a cost never makes a step faster). The engine changes regime with
the size of a step (on a CPU it runs small steps on one thread; a GPU fills its cores only from some
batch size on), so the tokens of a step can be split into ranges fitted separately (``splits``).

Fitting is plain least squares, so the model gives a step's mean time: latencies are sums of steps, and a
model of the typical (median) step would come out short wherever steps are noisy. Its error on steps it was
not fitted on is reported as MAPE, beside :func:`noise_floor`, the MAPE no model of the work alone can beat
(each kind of step predicted by the median of its own measured times).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minipd.engine.stats import StepStats, StepWork

#: The features, in the order of a coefficient vector.
FEATURES = ("constant", "prefill_tokens", "prefill_pairs", "decode_rows", "decode_context")


def features(work: StepWork) -> tuple[float, ...]:
    """A step's feature vector (see :data:`FEATURES`)."""
    return (1.0, work.prefill_tokens, work.prefill_pairs, work.decode_rows, work.decode_context)


def cycle_times(steps: Sequence[StepStats]) -> list[float]:
    """Each step's time as the engine spent it: its duration plus the work its loop did before the next step
    where the next record measured that (``overhead_before``: a disaggregated worker, whose queued requests wait in
    its socket where the scheduler does not see them); otherwise through to the next step's start while it had
    work left after the step (so the work between steps, outputs and new requests, is counted), and the step's
    own duration when it went idle after it, or for the last step."""
    steps = list(steps)
    times = []
    for i, s in enumerate(steps):
        following_overhead = steps[i + 1].overhead_before if i + 1 < len(steps) else None
        if following_overhead is not None:
            times.append(min(s.duration + following_overhead, max(s.duration, steps[i + 1].start_time - s.start_time)))
            continue
        busy = s.num_running + s.num_waiting + s.num_waiting_for_kv > 0
        following = steps[i + 1].start_time - s.start_time if i + 1 < len(steps) else -1.0
        times.append(following if busy and following >= s.duration else s.duration)
    return times


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``x @ c ≈ y`` with ``c >= 0``, exactly: the best of the unconstrained fits on each subset
    of the columns that comes out non-negative. The constrained optimum is the unconstrained fit on its own
    support, so it is among them; with the few features of a step model (at most 5: 31 subsets) this is cheap,
    where dropping the most negative coefficient and refitting can stop at a worse fit (it never takes a
    dropped column back)."""
    columns = x.shape[1]
    if columns > 10:
        raise ValueError(f"an exact non-negative fit of {columns} features would try 2^{columns} subsets; at most 10")
    best, best_residual = np.zeros(columns), float(y @ y)
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            chosen = list(subset)
            solution, *_ = np.linalg.lstsq(x[:, chosen], y, rcond=None)
            if (solution < 0).any():
                continue
            residual = y - x[:, chosen] @ solution
            squares = float(residual @ residual)
            if squares < best_residual * (1 - 1e-12):
                best = np.zeros(columns)
                best[chosen] = solution
                best_residual = squares
    return best


@dataclass(frozen=True)
class FittedStepTime:
    """Seconds per step = coefficients · :func:`features`, one set of coefficients per range of step tokens.

    Build with :meth:`fit`. ``splits`` are the largest step (in tokens) of each range but the last:
    ``(4,)`` fits steps of 1–4 tokens apart from larger ones.
    """

    splits: tuple[int, ...]
    coefficients: tuple[tuple[float, ...], ...]
    #: Where the steps came from (for the figure captions: the machine, the model, the engine options).
    source: str = ""

    def step_time(self, work: StepWork) -> float:
        tokens = work.num_tokens
        index = 0
        while index < len(self.splits) and tokens > self.splits[index]:
            index += 1
        c = self.coefficients[index]
        return (c[0] + c[1] * work.prefill_tokens + c[2] * work.prefill_pairs + c[3] * work.decode_rows
                + c[4] * work.decode_context)

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepWork, float]], splits: Sequence[int] = (),
            source: str = "") -> FittedStepTime:
        """Fit to measured steps: ``(work, seconds)`` pairs, such as :func:`timed_steps` makes of a run's
        ``StepStats``, by least squares: the model predicts a step's *mean* time, so that simulated latencies,
        sums of many steps, come out unbiased however noisy single steps are. A range of ``splits`` that holds
        no step is merged into the next; one with fewer steps than features gets a fixed cost and a cost per
        token only."""
        kept = [(w, t) for w, t in samples if w.num_tokens > 0 and t > 0]
        if not kept:
            raise ValueError("no measured step to fit (steps with tokens and a duration)")
        times = np.array([t for _, t in kept])
        x_all = np.array([features(w) for w, _ in kept], dtype=float)
        tokens = np.array([w.num_tokens for w, _ in kept])
        # Only the splits with steps on both sides.
        used = [s for s in sorted(set(splits)) if (tokens <= s).any() and (tokens > s).any()]
        splits = tuple(s for i, s in enumerate(used) if not i or ((tokens > used[i - 1]) & (tokens <= s)).any())
        bounds = (0, *splits, int(tokens.max()) + 1)
        coefficients = []
        for low, high in itertools.pairwise(bounds):
            mask = (tokens > low) & (tokens <= high)
            x, y = x_all[mask], times[mask]
            if mask.sum() < len(FEATURES):
                simple = np.stack([np.ones(len(y)), tokens[mask].astype(float)], axis=1)  # constant + tokens
                c0, c1 = _nonnegative_fit(simple, y)
                coefficients.append((float(c0), float(c1), 0.0, float(c1), 0.0))
                continue
            coefficients.append(tuple(float(c) for c in _nonnegative_fit(x, y)))
        return cls(splits, tuple(coefficients), source)

    def errors(self, samples: Sequence[tuple[StepWork, float]]) -> np.ndarray:
        """Relative error of the predicted time of each measured step (``predicted / measured - 1``)."""
        return np.array([self.step_time(w) / t - 1.0 for w, t in samples if w.num_tokens > 0 and t > 0])

    def mape(self, samples: Sequence[tuple[StepWork, float]]) -> float:
        """Mean absolute percentage error on measured steps (a fraction: 0.05 is 5%)."""
        return float(np.abs(self.errors(samples)).mean())

    def scaled(self, factor: float) -> FittedStepTime:
        """The same model on a machine ``factor`` times slower (every cost times ``factor``), such as
        :func:`speed_factor` measures for one run on a shared machine whose speed drifts."""
        if not factor > 0:
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        return FittedStepTime(self.splits, tuple(tuple(c * factor for c in row) for row in self.coefficients),
                              self.source)

    def describe(self) -> str:
        parts = []
        bounds = (0, *self.splits, None)
        for (low, high), c in zip(itertools.pairwise(bounds), self.coefficients, strict=True):
            span = f"{low + 1}+ tokens" if high is None else f"{low + 1}–{high} tokens"
            parts.append(f"{span}: {c[0] * 1e3:.2f} ms + {c[1] * 1e6:.1f} µs/prompt token + "
                         f"{c[2] * 1e9:.2f} ns/attention pair + {c[3] * 1e6:.1f} µs/decode row + "
                         f"{c[4] * 1e9:.2f} ns/key read")
        return "; ".join(parts)


def noise_floor(samples: Sequence[tuple[StepWork, float]]) -> float:
    """The MAPE of an oracle that predicts each step by the median time of the measured steps that did exactly
    the same work: how much of a model's error is the machine's noise rather than the model (steps whose work
    occurs once are left out)."""
    groups: dict[StepWork, list[float]] = {}
    for work, seconds in samples:
        if work.num_tokens > 0 and seconds > 0:
            groups.setdefault(work, []).append(seconds)
    errors = [abs(t / float(np.median(times)) - 1.0) for times in groups.values() if len(times) > 1 for t in times]
    return float(np.mean(errors)) if errors else 0.0


def speed_factor(model: FittedStepTime, samples: Sequence[tuple[StepWork, float]]) -> float:
    """How much slower the machine ran these measured steps than ``model`` predicts them: their measured seconds
    over the predicted, summed (1.0: as fitted; 1.05: 5% slower). One number for a whole run, so that the shape of
    the model (what each kind of step costs against another) stays as it was fitted elsewhere."""
    kept = [(w, t) for w, t in samples if w.num_tokens > 0 and t > 0]
    predicted = sum(model.step_time(w) for w, _ in kept)
    if not kept or predicted <= 0:
        raise ValueError("no measured step with work that the model gives a time to")
    return sum(t for _, t in kept) / predicted


def timed_steps(steps: Sequence[StepStats], on_core: bool = False) -> list[tuple[StepWork, float]]:
    """A run's steps (in order) as ``(work, seconds)``, timed as :func:`cycle_times` counts them; ``on_core``: less
    the time each step's thread waited for a core (:attr:`StepStats.cpu_wait`; a ValueError if a step has none)."""
    steps = list(steps)
    if on_core and any(s.cpu_wait is None for s in steps):
        raise ValueError("a step has no measured wait for a core (cpu_wait): not measured on this system or run")
    return [(s.work, t - (s.cpu_wait or 0.0) if on_core else t) for s, t in zip(steps, cycle_times(steps), strict=True)]


def held_out_split(samples: Sequence[tuple[StepWork, float]], every: int = 5
                   ) -> tuple[list[tuple[StepWork, float]], list[tuple[StepWork, float]]]:
    """Every ``every``-th step held out for testing, the rest for fitting (interleaved, so both see every
    phase of a run)."""
    samples = list(samples)
    return [x for i, x in enumerate(samples) if i % every], [x for i, x in enumerate(samples) if not i % every]


__all__ = ["FEATURES", "FittedStepTime", "cycle_times", "features", "held_out_split", "noise_floor",
           "speed_factor", "timed_steps"]
