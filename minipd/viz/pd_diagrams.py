"""Diagrams of what keeps a disaggregated deployment going (chapter 05): recovery from a dead worker, snapshots,
and backpressure before prefill."""

from __future__ import annotations

from typing import Any

PREFILL, DECODE, FRONT, DEAD, STORE = "#f6c28b", "#9cc3e6", "0.9", "#e8a0a0", "#c9e4c5"


def _box(ax: Any, x: float, y: float, text: str, color: str, w: float = 0.26, h: float = 0.16) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.015", fc=color, ec="0.3"))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)


def _arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], text: str = "",
           where: tuple[float, float] | None = None, color: str = "0.2", ls: str = "-") -> None:
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, lw=1.2, color=color, ls=ls))
    if text:
        x, y = where or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(x, y, text, ha="center", va="center", fontsize=7.5, color=color,
                bbox={"fc": "white", "ec": "none", "pad": 0.5})


def plot_pd_resilience(axes: Any = None) -> Any:
    """Three panels: a decode worker dies and its requests are recomputed elsewhere; a snapshot written and
    resumed by a fresh engine; requests held before prefill while no decode worker has room."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(15, 3.6), layout="constrained")
    recovery, snapshot, backpressure = axes

    _box(recovery, 0.17, 0.8, "front end\n(router)", FRONT)
    _box(recovery, 0.8, 0.8, "decode0\n✗ killed", DEAD)
    _box(recovery, 0.8, 0.25, "decode1", DECODE)
    _box(recovery, 0.17, 0.25, "prefill0", PREFILL)
    _arrow(recovery, (0.66, 0.8), (0.31, 0.8), "heartbeat stops:\nworker fenced", (0.49, 0.9))
    _arrow(recovery, (0.3, 0.72), (0.66, 0.32), "its requests: prompt +\ntokens so far, same seed", (0.48, 0.52))
    recovery.text(0.8, 0.05, "recomputes their K/V, then decodes on:\nthe same tokens (seeded by index)",
                  ha="center", fontsize=7.5)
    recovery.set_title("recovery: a worker dies")

    _box(snapshot, 0.17, 0.75, "engine\n(running requests)", DECODE)
    _box(snapshot, 0.5, 0.3, "snapshot folder\nmanifest.json\n(tokens, seeds, checksums)\nkv.safetensors",
         STORE, w=0.36, h=0.3)
    _box(snapshot, 0.83, 0.75, "fresh engine\n(resumes)", DECODE)
    _arrow(snapshot, (0.22, 0.66), (0.4, 0.46), "save_snapshot\n(staged, then swapped in)", (0.18, 0.5))
    _arrow(snapshot, (0.6, 0.46), (0.78, 0.66), "load_snapshot\n(every field checked)", (0.84, 0.5))
    _box(snapshot, 0.5, 0.82, "✗ crash", DEAD, w=0.16, h=0.1)
    snapshot.set_title("snapshots: resume without recomputing")

    _box(backpressure, 0.17, 0.55, "front end\nqueue ▮▮▮▮", FRONT)
    _box(backpressure, 0.52, 0.8, "prefill0", PREFILL)
    _box(backpressure, 0.85, 0.35, "decode0\nKV pool full", DECODE)
    _arrow(backpressure, (0.85, 0.45), (0.3, 0.58), "free blocks reported", (0.62, 0.5), color="tab:blue")
    _arrow(backpressure, (0.26, 0.64), (0.42, 0.76), "held back until a decode\nworker has room", (0.25, 0.85),
           color="tab:red", ls="--")
    backpressure.text(0.55, 0.08, "a prefill whose K/V nobody can take would only hold\nits blocks (and "
                      "the GPU) until the lease runs out", ha="center", fontsize=7.5)
    backpressure.set_title("backpressure: no room to decode, no prefill")

    for ax in axes:
        ax.set(xlim=(0, 1), ylim=(0, 1))
        ax.axis("off")
    return axes


__all__ = ["plot_pd_resilience"]
