"""Plots for adaptive KV precision: the formats under growing load, and one run's pool over time.

matplotlib is imported inside the functions: ``import minipd`` never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from minipd.bench.adaptive import LoadResult
    from minipd.engine.stats import StepStats

#: One colour per cache format, the same in every plot.
FORMAT_COLORS = {"auto": "tab:blue", "int8": "tab:green", "int4": "tab:red", "adaptive": "tab:purple"}
FORMAT_STYLES = {"auto": {"marker": "o", "ls": "-"}, "int8": {"marker": "s", "ls": "--", "ms": 8, "mfc": "none"},
                 "int4": {"marker": "^", "ls": "-.", "ms": 9, "mfc": "none"},
                 "adaptive": {"marker": "x", "ls": ":", "ms": 7}}


def plot_formats_under_load(results: Sequence[LoadResult], axes: Sequence[Axes] | None = None) -> Any:
    """Three panels against the number of requests in a burst: preemptions, most requests running at
    once, and greedy agreement with an unconstrained full-precision run; one line per format."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(12, 3.4), layout="constrained")
    panels = (("preemptions", lambda r: r.preemptions, "preempted (recomputed) requests"),
              ("max_running", lambda r: r.max_running, "most requests running at once"),
              ("agreement", lambda r: 100 * r.agreement, "greedy tokens equal to full precision (%)"))
    for ax, (_, value, label) in zip(axes, panels, strict=True):
        for variant in dict.fromkeys(r.variant for r in results):
            rows = sorted((r for r in results if r.variant == variant), key=lambda r: r.num_requests)
            # Distinct markers and dashes: formats that coincide (int8 and int4 often do) stay visible.
            ax.plot([r.num_requests for r in rows], [value(r) for r in rows], label=variant,
                    color=FORMAT_COLORS.get(variant), **FORMAT_STYLES.get(variant, {"marker": "o"}))
        ax.set_xlabel("requests in the burst")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
    axes[0].legend(title="kv_cache_dtype")
    return axes


def plot_adaptive_timeline(stats: Sequence[StepStats], thresholds: tuple[float, float] | None = None,
                           ax: Axes | None = None) -> Axes:
    """One adaptive run over its steps: the pool's usage, the running requests and how many of them are
    compressed, with the steps where newcomers were being compressed shaded."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.4), layout="constrained")
    steps = list(range(len(stats)))
    ax.plot(steps, [100 * s.kv_usage for s in stats], color="black", label="pool usage (%)")
    for step, s in zip(steps, stats, strict=True):
        if s.kv_compressing:
            ax.axvspan(step - 0.5, step + 0.5, color="tab:purple", alpha=0.12, lw=0)
    if thresholds is not None:
        for level in thresholds:
            ax.axhline(100 * level, color="0.6", ls=":", lw=1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("pool usage (%)")
    twin = ax.twinx()
    twin.plot(steps, [s.num_running for s in stats], color="tab:blue", label="running")
    twin.plot(steps, [s.num_compressed_running for s in stats], color="tab:purple", label="of them compressed")
    twin.set_ylabel("requests")
    lines = ax.get_lines()[:1] + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left", bbox_to_anchor=(1.08, 1.0),
              frameon=False)  # beside the plot: inside, it covered the curves
    ax.set_title("shaded: new requests are compressed")
    return ax
