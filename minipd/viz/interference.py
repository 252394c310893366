"""Prefill/decode interference on one engine: how a long prompt's prefill stalls the requests decoding.

A run of :func:`minipd.sim.batching.run_continuous` in which some requests decode steadily while a long
prompt arrives holds everything needed: each decoding request's token times (``outputs[i].metrics``)
and, per step, when it ran and whether the long prompt was being prefilled (``steps``).
:func:`interference_summary` reduces a run to a few numbers; :func:`plot_interference` draws every
decoding request's gap before each token against time, with the long prompt's prefill steps shaded.
matplotlib is imported inside the function: ``import minipd`` never pays for it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from minipd.sim.batching import Timeline
from minipd.viz.latency import TTFT_COLOR

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Interference", "interference_summary", "plot_interference", "prefill_spans"]


@dataclass(frozen=True)
class Interference:
    """One run's interference, in seconds: what the decoding requests saw while the long prompt was prefilled."""

    label: str
    #: Prompt tokens the long request computed in each of its prefill steps (one entry: not chunked).
    chunks: tuple[int, ...]
    #: The longest gap between two tokens of any decoding request.
    longest_gap: float
    #: The median gap of the decoding requests' tokens that came outside the long prompt's prefill.
    steady_gap: float
    #: The mean gap of the decoding requests' tokens that came while the long prompt was prefilled.
    prefill_gap: float
    #: The long prompt's time to first token.
    long_ttft: float

    @property
    def spike(self) -> float:
        """The longest gap as a multiple of the steady one."""
        return self.longest_gap / self.steady_gap


def prefill_spans(timeline: Timeline, index: int) -> list[tuple[float, float]]:
    """(start, end) wall-clock times (``time.perf_counter``) of the steps that prefilled request ``index``."""
    label = timeline.labels[index]
    return [(s.start, s.start + s.duration) for s in timeline.steps if s.phases.get(label) == "prefill"]


def _decoding(timeline: Timeline, long_index: int) -> list[int]:
    n = len(timeline.labels)
    long_index %= n
    return [i for i in range(n) if i != long_index]


def interference_summary(timeline: Timeline, long_index: int = -1, label: str | None = None) -> Interference:
    """The numbers behind :func:`plot_interference` for one run.

    Args:
        timeline: a finished run; every request but ``long_index`` is taken to be decoding steadily.
        long_index: which request is the long prompt (default: the last).
        label: a name for the run; by default the scheme.

    Raises:
        ValueError: when the long request was never prefilled, or no decoding request has two tokens.
    """
    spans = prefill_spans(timeline, long_index)
    if not spans:
        raise ValueError(f"request {timeline.labels[long_index]} has no prefill step in this run")
    first, last = spans[0][0], spans[-1][1]
    inside: list[float] = []
    outside: list[float] = []
    for i in _decoding(timeline, long_index):
        times = timeline.outputs[i].metrics.token_times
        for a, b in pairwise(times):
            (inside if first < b <= last else outside).append(b - a)
    if not inside + outside:
        raise ValueError("no decoding request produced two tokens")
    row = timeline.token_rows()[long_index]
    phases = timeline.phase_rows()[long_index]
    chunks = tuple(n for n, p in zip(row, phases, strict=True) if p == "prefill")
    ttft = timeline.outputs[long_index].metrics.ttft
    return Interference(
        label=label if label is not None else timeline.scheme,
        chunks=chunks,
        longest_gap=max(inside + outside),
        steady_gap=statistics.median(outside) if outside else float("nan"),
        prefill_gap=statistics.fmean(inside) if inside else float("nan"),
        long_ttft=float("nan") if ttft is None else ttft,
    )


def plot_interference(runs: Mapping[str, Timeline], long_index: int = -1, axes: Sequence[Axes] | None = None
                      ) -> list[Axes]:
    """Each decoding request's gap before every token (its per-token latency) against time, one panel per run.

    A gap is drawn as a plateau over the interval it lasted, so a stalled step shows as a wide, tall step.
    The steps that prefilled the long prompt are shaded (spans with gid ``"prefill"``), its arrival is a
    dashed line (gid ``"arrival"``), and each decoding request is a line with its label as gid
    (``"r0"``, ...). Time is in ms from the run's first step; the panels share both axes, so the spikes
    of different token budgets compare directly. Each panel's title gives the run's longest gap as a
    multiple of its steady gap (see :func:`interference_summary`).

    Args:
        runs: label (e.g. ``"budget 2048"``) -> a finished :func:`~minipd.sim.batching.run_continuous` run.
        long_index: which request is the long prompt (default: the last); the others are decoding.
        axes: one Axes per run; a new column of panels, 9 inches wide, is made when None.

    Returns:
        The Axes, one per run.
    """
    if not runs:
        raise ValueError("plot_interference needs at least one run")
    if axes is None:
        import matplotlib.pyplot as plt

        _, grid = plt.subplots(len(runs), 1, figsize=(9, 0.9 + 1.75 * len(runs)), sharex=True, sharey=True,
                               layout="constrained", squeeze=False)
        axes = list(grid[:, 0])
    axes = list(axes)
    if len(axes) != len(runs):
        raise ValueError(f"got {len(runs)} runs but {len(axes)} Axes")
    colors = ["#08519c", "#3182bd", "#6baed6", "#9ecae1", "#2171b5", "#4292c6"]
    for ax, (label, tl) in zip(axes, runs.items(), strict=True):
        t0 = tl.steps[0].start
        summary = interference_summary(tl, long_index, label)
        for k, (start, end) in enumerate(prefill_spans(tl, long_index)):
            ax.axvspan((start - t0) * 1e3, (end - t0) * 1e3, color=TTFT_COLOR, alpha=0.3, lw=0, gid="prefill",
                       label="long prompt's prefill steps" if k == 0 else None)
        arrival = tl.arrivals[long_index]
        arrival_step = next(s for s in tl.steps if s.index >= arrival)
        ax.axvline((arrival_step.start - t0) * 1e3, color="0.3", ls="--", lw=1, gid="arrival",
                   label="long prompt arrives")
        for n, i in enumerate(_decoding(tl, long_index)):
            times = tl.outputs[i].metrics.token_times
            if len(times) < 2:
                continue
            # Each gap is drawn as a plateau over the interval it lasted, with a dot at the token that ended it.
            gaps = [(b - a) * 1e3 for a, b in pairwise(times)]
            ax.plot([(t - t0) * 1e3 for t in times], gaps[:1] + gaps, drawstyle="steps-pre", marker=".", ms=4,
                    markevery=list(range(1, len(times))), lw=1, color=colors[n % len(colors)], label=tl.labels[i],
                    gid=tl.labels[i])
        ax.set_title(f"{label}: longest gap {summary.longest_gap * 1e3:.0f} ms = {summary.spike:.1f}× the steady "
                     f"{summary.steady_gap * 1e3:.1f} ms", loc="left", fontsize=10)
        ax.set_ylabel("gap before\ntoken (ms)")
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("time since the run's first step (ms)")
    axes[-1].legend(loc="upper right", fontsize="small", frameon=False, ncols=3)
    return axes
