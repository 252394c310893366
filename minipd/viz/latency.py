"""Latency plots for finished requests: when each token appeared, and TTFT/TPOT per request.

Every function takes :class:`~minipd.outputs.RequestOutput` objects (what ``LLM.generate`` returns)
and reads only their ``metrics``, so the same plots work for any engine version in the course.
matplotlib is imported inside the functions: ``import minipd`` never pays for it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from minipd.outputs import RequestOutput

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: Colours shared by the plots, so TTFT and TPOT look the same in every chapter.
TTFT_COLOR = "tab:orange"
TPOT_COLOR = "tab:blue"
QUEUE_COLOR = "0.85"


def _ms(seconds: float | None) -> float:
    """Seconds to milliseconds; a missing value becomes NaN, which matplotlib leaves undrawn."""
    return math.nan if seconds is None else seconds * 1e3


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _label(output: RequestOutput) -> str:
    return f"req {output.request_id}"


def latency_table(outputs: Sequence[RequestOutput]) -> str:
    """A plain-text table of prompt length, output length, TTFT and TPOT (ms) per request.

    A missing latency (TPOT of a one-token request) reads "n/a".
    """
    def cell(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"

    rows = [f"{'request':>8} {'prompt':>7} {'output':>7} {'TTFT ms':>9} {'TPOT ms':>9}"]
    for out in outputs:
        rows.append(f"{out.request_id:>8} {len(out.prompt_token_ids):>7} {len(out.token_ids):>7} "
                    f"{cell(out.metrics.ttft):>9} {cell(out.metrics.tpot):>9}")
    return "\n".join(rows)


def plot_token_timeline(outputs: Sequence[RequestOutput], ax: Axes | None = None) -> Axes:
    """One row per request on a shared time axis (ms since the earliest arrival).

    Each row splits TTFT into its two parts, the wait from arrival until the request was first
    scheduled (grey) and prefill up to the first token (orange), then puts a dot at every generated
    token, so TPOT is the spacing of the dots. A request without ``first_scheduled_time`` counts as
    scheduled on arrival. So tests and readers can find the plotted data, the bar containers in
    ``ax.containers`` are labelled ``"waiting"`` and ``"prefill"``, and the scatter collections
    carry a ``gid``: ``"arrival"``, ``"first_token"``, ``"tokens"``.

    Args:
        outputs: finished (or partly streamed) requests; rows follow this order, top to bottom.
        ax: Axes to draw on; a new figure is made when None.

    Returns:
        The Axes drawn on.
    """
    if not outputs:
        raise ValueError("plot_token_timeline needs at least one RequestOutput")
    ax = _axes(ax, (8, 1.0 + 0.45 * len(outputs)))
    t0 = min(out.metrics.arrival_time for out in outputs)

    def rel(t: float | None) -> float:
        return math.nan if t is None else (t - t0) * 1e3

    rows = range(len(outputs))
    arrivals = [rel(out.metrics.arrival_time) for out in outputs]
    scheduled = [a if out.metrics.first_scheduled_time is None else rel(out.metrics.first_scheduled_time)
                 for out, a in zip(outputs, arrivals, strict=True)]
    firsts = [rel(out.metrics.first_token_time) for out in outputs]

    waiting = ax.barh(rows, [s - a for a, s in zip(arrivals, scheduled, strict=True)], left=arrivals,
                      height=0.5, color=QUEUE_COLOR, label="waiting")
    prefill = ax.barh(rows, [f - s for s, f in zip(scheduled, firsts, strict=True)], left=scheduled,
                      height=0.5, color=TTFT_COLOR, alpha=0.8, label="prefill")
    arrival = ax.scatter(arrivals, rows, marker="|", s=250, color="black", label="arrival", gid="arrival",
                         zorder=3)

    xs: list[float] = []
    ys: list[int] = []
    for row, out in zip(rows, outputs, strict=True):
        times = [rel(t) for t in out.metrics.token_times]
        xs.extend(times)
        ys.extend([row] * len(times))
        # A thin line through the decode phase keeps sparse dots readable as one request.
        if times:
            ax.plot([times[0], times[-1]], [row, row], color="0.6", lw=0.8, zorder=1)
    tokens = ax.scatter(xs, ys, s=10, color=TPOT_COLOR, label="token", gid="tokens", zorder=4)
    first = ax.scatter(firsts, rows, s=45, facecolors="none", edgecolors="black", linewidths=1.0,
                       label="first token", gid="first_token", zorder=5)

    ax.set_yticks(list(rows), [_label(out) for out in outputs])
    ax.set_ylim(len(outputs) - 0.5, -0.5)  # first request on top
    ax.set_xlabel("time since first arrival (ms)")
    ax.set_title("token timeline")
    # Legend in the order a request lives through.
    ax.legend(handles=[arrival, waiting, prefill, first, tokens], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize="small", frameon=False)
    return ax


def plot_ttft_tpot(outputs: Sequence[RequestOutput], ax: Axes | None = None) -> Axes:
    """TTFT and TPOT of each request as side-by-side bars, in milliseconds, each bar labelled.

    The two bar containers in ``ax.containers`` are labelled ``"TTFT"`` and ``"TPOT"``; a request with fewer than two
    tokens has no TPOT, so its bar has zero height and reads "n/a".

    Args:
        outputs: requests to compare; bars follow this order, left to right.
        ax: Axes to draw on; a new figure is made when None.

    Returns:
        The Axes drawn on.
    """
    if not outputs:
        raise ValueError("plot_ttft_tpot needs at least one RequestOutput")
    ax = _axes(ax, (max(4.0, 1.2 * len(outputs) + 2), 3.2))
    width = 0.38
    xs = list(range(len(outputs)))
    ttft = [_ms(out.metrics.ttft) for out in outputs]
    tpot = [_ms(out.metrics.tpot) for out in outputs]
    for values, shift, name, color in ((ttft, -width / 2, "TTFT", TTFT_COLOR), (tpot, width / 2, "TPOT", TPOT_COLOR)):
        # A missing value gets a zero-height bar: bar_label skips NaN bars, and "n/a" must still show.
        heights = [0.0 if math.isnan(v) else v for v in values]
        bars = ax.bar([x + shift for x in xs], heights, width, color=color, label=name)
        ax.bar_label(bars, labels=["n/a" if math.isnan(v) else f"{v:.1f}" for v in values], fontsize="small",
                     padding=2)
    ax.set_xticks(xs, [_label(out) for out in outputs])
    ax.set_ylabel("milliseconds")
    ax.set_title("time to first token vs time per output token")
    # Headroom above the tallest bar keeps its label clear of the legend.
    tallest = max((v for v in ttft + tpot if not math.isnan(v)), default=0.0)
    if tallest > 0:
        ax.set_ylim(0, tallest * 1.35)
    ax.legend(frameon=False, loc="upper center", ncols=2)
    return ax


def plot_latency_vs(x: Sequence[float], outputs: Sequence[RequestOutput | Sequence[RequestOutput]],
                    xlabel: str, ax: Axes | None = None) -> Axes:
    """TTFT and TPOT (ms) as two lines against a parameter such as prompt length or batch size.

    Args:
        x: the parameter's values, one per point.
        outputs: for each value of ``x``, one request or several repeats; repeats are reduced to
            their median, which shrugs off the odd slow run on a busy machine.
        xlabel: what ``x`` is, for the axis label.
        ax: Axes to draw on; a new figure is made when None.

    Returns:
        The Axes drawn on; the two lines have ``gid`` ``"ttft"`` and ``"tpot"``.
    """
    if len(x) != len(outputs):
        raise ValueError(f"x has {len(x)} values but outputs has {len(outputs)} entries")
    ax = _axes(ax, (5.5, 3.2))

    def median_ms(entry: RequestOutput | Sequence[RequestOutput], metric: str) -> float:
        group = [entry] if isinstance(entry, RequestOutput) else list(entry)
        values = [getattr(out.metrics, metric) for out in group]
        present = [v for v in values if v is not None]
        return _ms(statistics.median(present)) if present else math.nan

    ax.plot(x, [median_ms(e, "ttft") for e in outputs], "o-", color=TTFT_COLOR, label="TTFT", gid="ttft")
    ax.plot(x, [median_ms(e, "tpot") for e in outputs], "s-", color=TPOT_COLOR, label="TPOT", gid="tpot")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("milliseconds")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False)
    return ax
