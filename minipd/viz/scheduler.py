"""Scheduler plots: who ran in each step, what a step computed, the KV pool, and throughput vs latency.

The timeline plot reads a :class:`~minipd.sim.batching.Timeline` (what :mod:`minipd.sim.batching` records);
the step plots read the engine's own per-step records, ``llm.engine.step_stats``
(:class:`~minipd.engine.stats.StepStats`). matplotlib is imported inside the functions.
So that tests and readers can find the plotted data, every artist that carries data has a ``gid``
or a label, named in each function's docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from minipd.engine.stats import StepStats
from minipd.outputs import RequestOutput
from minipd.sim.batching import PHASES, LoadPoint, Timeline
from minipd.viz.latency import QUEUE_COLOR, TPOT_COLOR, TTFT_COLOR, _axes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: One colour per phase of :data:`minipd.sim.batching.PHASES`; prefill and decode match the latency plots.
PHASE_COLORS = {
    "": "white",
    "queued": QUEUE_COLOR,
    "prefill": TTFT_COLOR,
    "decode": TPOT_COLOR,
    "stalled": "gold",
    "preempted": "tab:red",
    "idle": "0.45",
    "done": "white",
}

#: What each phase means, for legends.
PHASE_LABELS = {
    "queued": "queued",
    "prefill": "prefill (chunk)",
    "decode": "decode",
    "stalled": "stalled (no budget)",
    "preempted": "preempted",
    "idle": "idle slot (batch still running)",
}


def phase_codes(timeline: Timeline) -> list[list[int]]:
    """The timeline as numbers: row per request, column per step, each cell the phase's index in PHASES."""
    return [[PHASES.index(p) for p in row] for row in timeline.phase_rows()]


def plot_schedule_timeline(timeline: Timeline, ax: Axes | None = None, title: str | None = None,
                           show_tokens: bool | None = None) -> Axes:
    """Per-request rows over engine steps, each cell coloured by what the request did in that step.

    The cells are one image, ``ax.images[0]``, whose array is :func:`phase_codes`. With
    ``show_tokens`` (default: when there are at most 40 steps), each prefill cell is labelled with
    the number of tokens computed in it, so chunked prefill shows as a run of small numbers; these
    labels are ``ax.texts``, in row order.

    Args:
        timeline: what :func:`minipd.sim.batching.run_continuous` (or ``run_static`` / ``run_dynamic``) recorded.
        ax: Axes to draw on; a new figure is made when None.
        title: the plot's title; by default the batching scheme and its step count.
        show_tokens: label prefill cells with their token counts.

    Returns:
        The Axes drawn on.
    """
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    if not timeline.steps:
        raise ValueError("plot_schedule_timeline needs a timeline with at least one step")
    rows = len(timeline.labels)
    ax = _axes(ax, (min(12.0, 2.5 + 0.22 * timeline.num_steps), 0.9 + 0.32 * rows))
    codes = phase_codes(timeline)
    cmap = ListedColormap([PHASE_COLORS[p] for p in PHASES])
    norm = BoundaryNorm([i - 0.5 for i in range(len(PHASES) + 1)], len(PHASES))
    ax.imshow(codes, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest",
              extent=(-0.5, timeline.num_steps - 0.5, rows - 0.5, -0.5))
    # An image resets the x-limits to its own extent, which on axes sharing x would clip a longer timeline
    # drawn before: span the longest timeline of every sibling.
    siblings = ax.get_shared_x_axes().get_siblings(ax)
    ax.set_xlim(-0.5, max(image.get_extent()[1] for sibling in siblings for image in sibling.images))
    # Thin white lines between cells keep neighbouring steps apart.
    ax.set_xticks([x - 0.5 for x in range(timeline.num_steps + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(rows + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    if show_tokens is None:
        show_tokens = timeline.num_steps <= 40
    if show_tokens:
        for r, (phases, tokens) in enumerate(zip(timeline.phase_rows(), timeline.token_rows(), strict=True)):
            for s, (phase, n) in enumerate(zip(phases, tokens, strict=True)):
                if phase == "prefill":
                    ax.text(s, r, str(n), ha="center", va="center", fontsize=6 if n >= 100 else 7)
    ax.set_yticks(range(rows), timeline.labels)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("engine step")
    ax.set_title(title if title is not None else f"{timeline.scheme} batching: {timeline.num_steps} steps")
    present = [p for p in PHASE_LABELS if any(p in row for row in timeline.phase_rows())]
    ax.legend(handles=[Patch(color=PHASE_COLORS[p], label=PHASE_LABELS[p]) for p in present],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    return ax


def plot_step_tokens(step_stats: Sequence[StepStats], ax: Axes | None = None, show_duration: bool = True) -> Axes:
    """What each engine step computed: prefill and decode tokens as stacked bars, and its duration.

    The bar containers are labelled ``"prefill"`` and ``"decode"``; steps with preemptions get a red
    marker (gid ``"preemptions"``) above the bar; with ``show_duration`` the step time in ms is a
    line (gid ``"duration"``) on a second y axis, available as ``ax.duration_axes``.

    Args:
        step_stats: the engine's records, e.g. ``llm.engine.step_stats`` or ``timeline.step_stats``.
        ax: Axes to draw on; a new figure is made when None.
        show_duration: also draw each step's wall time.

    Returns:
        The Axes with the bars.
    """
    if not step_stats:
        raise ValueError("plot_step_tokens needs at least one StepStats")
    ax = _axes(ax, (8, 3))
    steps = list(range(len(step_stats)))
    prefill = [s.num_prefill_tokens for s in step_stats]
    decode = [s.num_decode_tokens for s in step_stats]
    ax.bar(steps, prefill, width=0.8, color=TTFT_COLOR, label="prefill")
    ax.bar(steps, decode, width=0.8, bottom=prefill, color=TPOT_COLOR, label="decode")
    hit = [(i, s.num_tokens) for i, s in enumerate(step_stats) if s.num_preemptions]
    ax.scatter([i for i, _ in hit], [n for _, n in hit], marker="v", color="tab:red", zorder=3, label="preemption",
               gid="preemptions")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the step")
    handles, _ = ax.get_legend_handles_labels()
    if show_duration:
        twin = ax.twinx()
        (line,) = twin.plot(steps, [s.duration * 1e3 for s in step_stats], color="black", lw=1.2, marker=".",
                            label="step time (ms)", gid="duration")
        twin.set_ylabel("step time (ms)")
        twin.set_ylim(bottom=0)
        ax.duration_axes = twin  # type: ignore[attr-defined]
        handles.append(line)
    if not hit:
        handles = [h for h in handles if h.get_label() != "preemption"]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.1 if show_duration else 1.01, 1),
              fontsize="small", frameon=False)
    return ax


def plot_kv_blocks(step_stats: Sequence[StepStats], ax: Axes | None = None) -> Axes:
    """KV blocks in use after each engine step, against the pool's size, with preemptions marked.

    Lines: ``"used"`` (blocks held) and ``"capacity"`` (the pool); preemptions are a scatter with
    gid ``"preemptions"``, at the blocks in use after that step.
    """
    if not step_stats:
        raise ValueError("plot_kv_blocks needs at least one StepStats")
    ax = _axes(ax, (7, 3))
    steps = list(range(len(step_stats)))
    used = [s.kv_blocks_used for s in step_stats]
    capacity = [s.kv_blocks_used + s.kv_blocks_free for s in step_stats]
    ax.fill_between(steps, used, step="mid", color=TPOT_COLOR, alpha=0.25)
    ax.plot(steps, used, drawstyle="steps-mid", color=TPOT_COLOR, label="blocks in use", gid="used")
    ax.plot(steps, capacity, color="black", ls="--", lw=1, label="pool size", gid="capacity")
    hit = [(i, s.kv_blocks_used) for i, s in enumerate(step_stats) if s.num_preemptions]
    ax.scatter([i for i, _ in hit], [u for _, u in hit], marker="v", s=50, color="tab:red", zorder=3,
               label="preemption", gid="preemptions")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    ax.set_ylim(0, max(capacity) * 1.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    return ax


def plot_token_gaps(outputs: Mapping[str, RequestOutput], ax: Axes | None = None) -> Axes:
    """The gap before each output token (ms), one line per labelled request: TPOT spikes stand out.

    Point ``i`` is the time between tokens ``i`` and ``i + 1``; each line has the label as its gid.
    """
    if not outputs:
        raise ValueError("plot_token_gaps needs at least one RequestOutput")
    ax = _axes(ax, (7, 3))
    for label, out in outputs.items():
        gaps = [g * 1e3 for g in out.metrics.inter_token_latencies]
        ax.plot(range(1, len(gaps) + 1), gaps, marker=".", label=label, gid=label)
    ax.set_xlabel("output token")
    ax.set_ylabel("gap before it (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False, fontsize="small")
    return ax


def plot_throughput_latency(series: Mapping[str, Sequence[LoadPoint]], axes: Sequence[Axes] | None = None
                            ) -> tuple[Axes, Axes]:
    """Throughput against mean TPOT (left) and mean TTFT (right), one line per series.

    Each series is a knob swept over values (e.g. ``max_num_seqs`` 1, 2, 4, 8), one
    :class:`~minipd.sim.batching.LoadPoint` per value, labelled next to its point. The lines have gid
    ``"<series>/tpot"`` and ``"<series>/ttft"``; x is in ms, y in output tokens per second.

    Returns:
        The two Axes (TPOT, TTFT).
    """
    if not series or not any(series.values()):
        raise ValueError("plot_throughput_latency needs at least one LoadPoint")
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True, layout="constrained")
    left, right = axes
    # Each series labels its points on its own side (above, below, ...), so nearby points of two
    # series do not print their labels on top of each other.
    sides = [((5, 4), "bottom"), ((5, -5), "top"), ((-5, 4), "bottom"), ((-5, -5), "top")]
    for index, (name, points) in enumerate(series.items()):
        ys = [p.throughput for p in points]
        offset, va = sides[index % len(sides)]
        for ax, metric, key in ((left, "mean_tpot", "tpot"), (right, "mean_ttft", "ttft")):
            xs = [getattr(p, metric) * 1e3 for p in points]
            (line,) = ax.plot(xs, ys, "o-", label=name, gid=f"{name}/{key}")
            for p, x, y in zip(points, xs, ys, strict=True):
                if not (math.isnan(x) or math.isnan(y)):
                    ax.annotate(p.label, (x, y), textcoords="offset points", xytext=offset, fontsize="small",
                                color=line.get_color(), va=va, ha="left" if offset[0] > 0 else "right")
    left.set_xlabel("mean TPOT (ms)")
    right.set_xlabel("mean TTFT (ms)")
    left.set_ylabel("throughput (output tokens/s)")
    for ax in (left, right):
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    left.set_title("faster streams or more tokens per second")
    right.set_title("shorter waits or more tokens per second")
    left.legend(frameon=False, fontsize="small")
    return left, right


def scheduler_explorer(draw: Callable[[int, int], object], budgets: Sequence[int], caps: Sequence[int],
                       budget: int | None = None, cap: int | None = None) -> Any:
    """Two sliders, the token budget and the batch cap, that redraw ``draw(budget, cap)`` when moved.

    ``draw`` runs whatever it likes and draws with matplotlib; its figure is shown under the
    sliders. Returns the widget to display (ipywidgets is imported here). Nothing is drawn until it
    is shown in a live kernel, so pair it with a static figure of a few settings.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from minipd.viz.explorer import explorer_box

    if not budgets or not caps:
        raise ValueError("scheduler_explorer needs at least one budget and one cap")
    style = {"description_width": "initial"}
    # Wide enough that each of a handful of settings is a distinct stop under the mouse.
    budget_slider = widgets.SelectionSlider(options=list(budgets), value=budget if budget is not None else budgets[-1],
                                            description="max_num_batched_tokens", continuous_update=False, style=style,
                                            layout=widgets.Layout(width="480px"))
    cap_slider = widgets.SelectionSlider(options=list(caps), value=cap if cap is not None else caps[-1],
                                         description="max_num_seqs", continuous_update=False, style=style)
    out = widgets.Output()

    def redraw(_change: object = None) -> None:
        with out:
            out.clear_output(wait=True)
            draw(budget_slider.value, cap_slider.value)
            plt.show()

    budget_slider.observe(redraw, names="value")
    cap_slider.observe(redraw, names="value")
    redraw()

    return explorer_box([widgets.HBox([budget_slider, cap_slider]), out], "scheduler explorer",
                        "see the static figure above")
