"""Plots for expert parallelism: who sends what to whom, one layer call's timeline, and the wire's bytes.

matplotlib is imported inside the functions: ``import minipd`` never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from minipd.moe.expert_parallel import CommStats

#: Colours of the three stages, the same in every plot.
STAGE_COLORS = {"dispatch": "tab:blue", "experts": "tab:orange", "combine": "tab:green"}


def plot_ep_traffic(stats: CommStats, world_size: int, experts_per_rank: int, ax: Axes | None = None) -> Axes:
    """Rank 0 (tokens, attention, routers, its experts) and the other ranks (experts only) as boxes, with
    the KiB dispatched to each and combined back from each, as measured in ``stats``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.4 + 1.1 * max(world_size - 1, 2)), layout="constrained")
    ys = [1.1 * (world_size - 1 - i) for i in range(world_size - 1)] or [0.0]
    centre = sum(ys) / len(ys)
    ax.set_xlim(0, 10)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
    ax.axis("off")
    ax.add_patch(FancyBboxPatch((0.2, centre - 0.55), 3.0, 1.1, boxstyle="round,pad=0.05", fc="#dbe9f6", ec="k"))
    ax.text(1.7, centre, f"rank 0\nrequests, KV cache, attention,\nrouters + experts 0–{experts_per_rank - 1}",
            ha="center", va="center", fontsize=9)
    for rank, y in enumerate(ys, start=1):
        first = rank * experts_per_rank
        ax.add_patch(FancyBboxPatch((6.8, y - 0.35), 3.0, 0.7, boxstyle="round,pad=0.05", fc="#fde9d9", ec="k"))
        ax.text(8.3, y, f"rank {rank}: experts {first}–{first + experts_per_rank - 1}", ha="center", va="center",
                fontsize=9)
        out = stats.dispatch_sent_to.get(rank, 0) / 1024
        back = stats.combine_received_from.get(rank, 0) / 1024
        arrows = ((0.15, (3.3, centre + 0.15), (6.75, y + 0.15), f"dispatch {out:,.1f} KiB", "dispatch"),
                  (-0.15, (6.75, y - 0.15), (3.3, centre - 0.15), f"combine {back:,.1f} KiB", "combine"))
        for dy, start, end, label, stage in arrows:
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=STAGE_COLORS[stage],
                                         lw=1.5))
            ax.text(5.0, (centre + y) / 2 + 1.6 * dy, label, color=STAGE_COLORS[stage], ha="center", va="center",
                    fontsize=8, bbox=dict(fc="white", ec="none", pad=0.5))
    ax.set_title(f"all-to-all traffic over {stats.calls} layer calls (rank 0's view)")
    return ax


def plot_layer_timeline(timelines: dict[str, Sequence[tuple[str, float, float]]],
                        axes: Sequence[Axes] | None = None) -> Any:
    """One layer call per panel (e.g. ``{"serial": events, "overlapped": events}`` from
    ``ExpertParallelGroup.trace``): transfers in flight on one lane, the experts computing on another,
    in ms from the call's first event. A transfer's bar ends when the rank learned it was done."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(len(timelines), 1, figsize=(8, 1.6 * len(timelines) + 0.8), sharex=True,
                               layout="constrained", squeeze=False)
        axes = list(axes[:, 0])
    for ax, (title, events) in zip(axes, timelines.items(), strict=True):
        origin = min(start for _, start, _ in events)
        for what, start, end in events:
            stage, micro_batch = what.split()
            # Lanes: each micro-batch's transfers on its own line (they may be in flight together), experts on top.
            lane = 2 if stage == "experts" else int(micro_batch)
            ax.barh(lane, (end - start) * 1e3, left=(start - origin) * 1e3, height=0.6, color=STAGE_COLORS[stage],
                    hatch="//" if micro_batch == "1" else None, edgecolor="k", lw=0.5)
        ax.set_yticks([0, 1, 2], ["network, micro-batch 0", "network, micro-batch 1", "experts"])
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xlabel("ms since the layer call began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STAGE_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="k", hatch="//"))
    axes[0].figure.legend(handles, [*STAGE_COLORS, "micro-batch 1"], loc="outside lower center", fontsize=8,
                          ncols=4)
    return axes


def plot_wire_bytes(rows: Sequence[dict[str, Any]], ax: Axes | None = None) -> Axes:
    """Bytes per dispatched row out and per answer back, per wire format (rows from
    :func:`minipd.bench.expert_parallel.wire_table`), with the greedy agreement written over each format."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3), layout="constrained")
    names = [str(r["wire"]) for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["dispatch B/row"] for r in rows], 0.4, label="dispatch (row out)",
           color=STAGE_COLORS["dispatch"])
    ax.bar([x + 0.2 for x in xs], [r["combine B/row"] for r in rows], 0.4, label="combine (answer back)",
           color=STAGE_COLORS["combine"])
    for x, r in zip(xs, rows, strict=True):
        top = max(r["dispatch B/row"], r["combine B/row"])
        ax.text(x, top * 1.03, f"greedy {r['greedy agreement']:.0%}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("bytes per (token, expert) row")
    ax.set_ylim(0, max(max(r["dispatch B/row"], r["combine B/row"]) for r in rows) * 1.45)
    ax.legend(fontsize=8, loc="upper right", ncols=2)
    return ax
