"""Diagrams of how compressed KV caches are laid out (chapter 06): who shares a quantization scale, KIVI's
residual window, and an adaptive pool whose new pages change format with the load."""

from __future__ import annotations

from typing import Any


def plot_scale_sharing(tokens: int = 8, channels: int = 8, group: int = 4, axes: Any = None) -> Any:
    """A (tokens × channels) slice of K, coloured by the scale each value shares: one per tensor, one per token
    (a row), one per channel (a column), one per group of ``group`` channels of a token."""
    import matplotlib.pyplot as plt
    import numpy as np

    if axes is None:
        _, axes = plt.subplots(1, 4, figsize=(14, 3.3), layout="constrained")
    rows, cols = np.indices((tokens, channels))
    schemes = {"per tensor: 1 scale": np.zeros((tokens, channels)),
               f"per token: {tokens} scales": rows,
               f"per channel: {channels} scales": cols,
               f"per group of {group}: {tokens * channels // group} scales": rows * (channels // group) + cols // group}
    for ax, (title, ids) in zip(axes, schemes.items(), strict=True):
        ax.imshow(ids % 10, cmap="tab10", vmin=0, vmax=9)
        ax.set_xticks(range(channels), [""] * channels)
        ax.set_yticks(range(tokens), [""] * tokens)
        ax.set(xlabel="channels (head dim) →", ylabel="tokens ↓", title=title)
        ax.grid(False)
    axes[0].figure.suptitle("values of one colour share one scale: a value far from its neighbours (an outlier "
                            "channel) inflates the error of everything it shares with")
    return axes


def plot_kivi_residual(blocks: int = 4, block_size: int = 4, filled: int = 3, ax: Any = None) -> Any:
    """A request's blocks in an int4 KIVI pool: full blocks as codes (K per channel, V per token), the block being
    filled in full precision in a residual slot, whose id in the block table is past the end of the pool."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    for b in range(blocks):
        last = b == blocks - 1
        for t in range(block_size):
            written = not last or t < filled
            color = ("#f6c28b" if last else "#9cc3e6") if written else "white"
            ax.add_patch(Rectangle((b * (block_size + 1) + t, 1), 1, 1, fc=color, ec="0.3"))
        ax.text(b * (block_size + 1) + block_size / 2, 2.35,
                "filling: fp32 in a\nresidual slot" if last else f"block {b}: int4 codes\nK per channel, V per token",
                ha="center", fontsize=8)
    table = ["7", "2", "9", "N + 0"]
    for b, entry in enumerate(table[:blocks]):
        ax.add_patch(Rectangle((b * 2.2 + 2, -1.2), 2, 0.8, fc="0.93", ec="0.3"))
        ax.text(b * 2.2 + 3, -0.8, entry, ha="center", va="center", fontsize=9)
    ax.text(0.2, -0.8, "block table\nthe kernels read", ha="left", va="center", fontsize=8)
    ax.add_patch(FancyArrowPatch(((blocks - 1) * 2.2 + 3, -0.35), ((blocks - 1) * (block_size + 1) + 2, 0.95),
                                 arrowstyle="-|>", mutation_scale=12, color="tab:red"))
    ax.text((blocks - 1) * (block_size + 1) + 3.3, 0.35, "an id past the pool's N blocks\nnames a residual slot",
            fontsize=8, color="tab:red")
    ax.set(xlim=(-0.5, blocks * (block_size + 1)), ylim=(-1.6, 3.1))
    ax.axis("off")
    ax.set_title("KIVI in a paged pool: a per-channel scale needs the whole block, so the filling block waits "
                 "in full precision")
    return ax


def plot_adaptive_pages(usage: tuple[float, ...] = (0.1, 0.25, 0.42, 0.58, 0.66, 0.55, 0.35, 0.2),
                        thresholds: tuple[float, float] = (0.3, 0.5), ax: Any = None) -> Any:
    """An adaptive pool over time: the share of blocks in use, and the format new requests' pages get — full
    precision below the lower threshold, int8 above the upper one, and unchanged in between (hysteresis)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
    compressing, formats = False, []
    for u in usage:
        if u >= thresholds[1]:
            compressing = True
        elif u < thresholds[0]:
            compressing = False
        formats.append(compressing)
    for step, (u, packed) in enumerate(zip(usage, formats, strict=True)):
        ax.bar(step, 100 * u, color="tab:purple" if packed else "tab:blue", width=0.7)
    for level, name in zip(thresholds, ("back to full precision below", "compress new pages above"), strict=True):
        ax.axhline(100 * level, color="0.4", ls=":", lw=1)
        ax.text(len(usage) - 0.4, 100 * level + 1.5, f"{name} {level:.0%}", ha="right", fontsize=8)
    ax.set(xlabel="time (engine steps, coarse)", ylabel="pool in use (%)", ylim=(0, 100),
           title="adaptive precision: blue, new pages full precision; purple, new pages int8")
    return ax


__all__ = ["plot_adaptive_pages", "plot_kivi_residual", "plot_scale_sharing"]
