"""Pictures of the KV cache: a paged pool with its block tables, and the space each allocation wastes.

:func:`snapshot_pool` copies what a :class:`~minipd.kv.block_manager.BlockManager` holds at one
moment; :func:`plot_block_pool` draws such a snapshot, :func:`plot_block_pool_states` several of
them side by side (the static figure), and :func:`block_pool_stepper` an ipywidgets stepper over a
list of them. :func:`plot_fragmentation` and :func:`plot_request_reservations` compare the tokens
sequences really use with what an allocation scheme reserves for them.

matplotlib and ipywidgets are imported inside the functions: ``import minipd`` never pays for them.
So tests and readers can find the plotted data, artists carry a ``gid`` (see each function).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minipd.kv.block_manager import BlockAllocation, BlockManager

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: One colour per sequence, in order of first appearance; grey is kept for cached blocks.
SEQUENCE_PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                    "tab:olive", "tab:cyan")
#: A free block whose contents are still cached (reusable until evicted).
CACHED_COLOR = "0.72"
#: A free block with nothing worth keeping.
FREE_COLOR = "white"
#: Reservation schemes in :func:`plot_request_reservations`, in order.
SCHEME_COLORS = ("0.55", "tab:orange", "tab:purple", "tab:green", "tab:cyan")
USED_COLOR = "tab:blue"
WASTE_COLOR = "tab:red"


@dataclass(frozen=True)
class PoolSnapshot:
    """What a block manager held at one moment, plus how many tokens each sequence has.

    ``tables`` maps each live sequence to its block table; ``free_order`` lists the free blocks in
    the order they will be handed out (so a cached block early in it is the next to be evicted).
    """

    caption: str
    num_blocks: int
    block_size: int
    tables: dict[str, tuple[int, ...]]
    num_tokens: dict[str, int]
    ref_counts: tuple[int, ...]
    #: Per block: True when it holds a registered prefix (reusable by a later request).
    cached: tuple[bool, ...]
    free_order: tuple[int, ...]
    evictions: int = 0
    hit_rate: float = 0.0

    def owners(self, block_id: int) -> list[str]:
        """The sequences whose block table contains ``block_id``, in table order."""
        return [name for name, table in self.tables.items() if block_id in table]

    def tokens_in_block(self, block_id: int) -> int:
        """How many slots of ``block_id`` hold a token: full if cached or shared, else from its owner."""
        owners = self.owners(block_id)
        if not owners:
            return self.block_size if self.cached[block_id] else 0
        name = owners[0]
        index = self.tables[name].index(block_id)
        return max(0, min(self.block_size, self.num_tokens[name] - index * self.block_size))


def snapshot_pool(bm: BlockManager, sequences: Mapping[str, tuple[BlockAllocation, int]],
                  caption: str = "") -> PoolSnapshot:
    """Copy the state of ``bm`` and of ``sequences`` (name -> (allocation, tokens it holds)) now."""
    return PoolSnapshot(
        caption=caption,
        num_blocks=bm.num_blocks,
        block_size=bm.block_size,
        tables={name: tuple(alloc.block_table) for name, (alloc, _) in sequences.items() if alloc.block_table},
        num_tokens={name: n for name, (alloc, n) in sequences.items() if alloc.block_table},
        ref_counts=tuple(b.ref_count for b in bm.blocks),
        cached=tuple(b.block_hash is not None for b in bm.blocks),
        free_order=tuple(bm.free),
        evictions=bm.evictions,
        hit_rate=bm.stats.hit_rate,
    )


def sequence_colors(names: Iterable[str]) -> dict[str, str]:
    """A colour per sequence name, in order of first appearance, cycling through the palette."""
    unique = list(dict.fromkeys(names))
    return {name: SEQUENCE_PALETTE[i % len(SEQUENCE_PALETTE)] for i, name in enumerate(unique)}


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


_BLOCK_W, _GAP, _ROW_H, _TABLE_H = 1.0, 0.3, 2.0, 0.75


def _pool_layout(snap: PoolSnapshot, per_row: int | None) -> tuple[int, int]:
    per_row = per_row or min(snap.num_blocks, 12)
    return per_row, math.ceil(snap.num_blocks / per_row)


def plot_block_pool(snap: PoolSnapshot, ax: Axes | None = None, colors: Mapping[str, str] | None = None,
                    per_row: int | None = None, min_tables: int = 0) -> Axes:
    """Draw the physical pool of ``snap`` and, below it, each sequence's block table.

    Each block is a box of ``block_size`` slots; a slot holding a token takes its sequence's colour
    (a block shared by several sequences is striped in all their colours), a free block whose
    contents are still cached is grey, an empty free block white. Above a block is its id; below,
    ``ref n`` while sequences hold it, or ``next k`` for the k-th free block to be handed out.
    Block table entry ``j`` of a sequence shows the physical block behind its logical block ``j``.

    Artists carry a ``gid``: ``"block:<id>"`` for each block's outline, ``"slot:<id>:<offset>"`` for
    each filled slot, ``"table:<name>:<j>"`` for each table entry (its text is the physical id).

    Args:
        snap: what to draw, from :func:`snapshot_pool`.
        ax: Axes to draw on; a new figure is made when None.
        colors: sequence name -> colour, to keep colours stable across snapshots.
        per_row: blocks per row of the pool drawing (at most 12 by default).
        min_tables: leave room for at least this many block tables, so that a series of snapshots
            (a stepper) keeps one size however many sequences each holds.

    Returns:
        The Axes drawn on.
    """
    from matplotlib.patches import Rectangle

    colors = dict(colors) if colors is not None else sequence_colors(snap.tables)
    per_row, rows = _pool_layout(snap, per_row)
    width = per_row * (_BLOCK_W + _GAP)
    tables_room = max(len(snap.tables), min_tables)
    height = rows * _ROW_H + tables_room * _TABLE_H + 0.8
    ax = _new_axes(ax, (max(5.0, 0.62 * width + 1.5), 0.62 * height + 0.6))
    free_rank = {b: k + 1 for k, b in enumerate(snap.free_order)}
    slot_w = _BLOCK_W / snap.block_size

    for b in range(snap.num_blocks):
        row, col = divmod(b, per_row)
        x, y = col * (_BLOCK_W + _GAP), -row * _ROW_H
        owners = snap.owners(b)
        filled = snap.tokens_in_block(b)
        shades = [colors.get(name, "0.4") for name in owners] or [CACHED_COLOR]
        for j in range(filled):
            stripe = 1.0 / len(shades)
            for k, shade in enumerate(shades):
                ax.add_patch(Rectangle((x + j * slot_w, y + k * stripe), slot_w, stripe, facecolor=shade,
                                       edgecolor="none", gid=f"slot:{b}:{j}" if k == 0 else None))
        for j in range(1, snap.block_size):  # slot separators
            ax.plot([x + j * slot_w] * 2, [y, y + 1], color="0.85" if j >= filled else "white", lw=0.6)
        ax.add_patch(Rectangle((x, y), _BLOCK_W, 1, facecolor="none", edgecolor="0.25", lw=1.2, gid=f"block:{b}"))
        ax.text(x + _BLOCK_W / 2, y + 1.08, str(b), ha="center", va="bottom", fontsize=8, color="0.3")
        if snap.ref_counts[b]:
            label = f"ref {snap.ref_counts[b]}"
        else:
            label = f"next {free_rank[b]}" if b in free_rank else ""
        ax.text(x + _BLOCK_W / 2, y - 0.08, label, ha="center", va="top", fontsize=7,
                color="0.15" if snap.ref_counts[b] else "0.45")

    top = -(rows - 1) * _ROW_H - 0.9
    for i, (name, table) in enumerate(snap.tables.items()):
        y = top - (i + 1) * _TABLE_H
        ax.text(-0.15, y + 0.27, f"{name} · {snap.num_tokens[name]} tokens", ha="right", va="center", fontsize=8,
                color=colors.get(name, "0.2"), fontweight="bold")
        for j, block_id in enumerate(table):
            x = j * 0.75
            ax.add_patch(Rectangle((x, y), 0.65, 0.55, facecolor=colors.get(name, "0.4"), alpha=0.85,
                                   edgecolor="none", gid=f"table:{name}:{j}"))
            ax.text(x + 0.325, y + 0.27, str(block_id), ha="center", va="center", fontsize=8, color="white",
                    gid=f"table:{name}:{j}")
    if snap.tables:
        ax.text(-0.15, top + 0.05, "block tables", ha="right", va="center", fontsize=8, color="0.3")

    used = sum(1 for r in snap.ref_counts if r)
    kept = sum(1 for b in snap.free_order if snap.cached[b])
    stats = (f"{used} used, {len(snap.free_order)} free ({kept} still cached) of {snap.num_blocks} blocks · "
             f"evictions {snap.evictions}")
    ax.set_title(f"{snap.caption}\n{stats}" if snap.caption else stats, fontsize=9, loc="left")
    bottom = top - tables_room * _TABLE_H - 0.2
    ax.set_xlim(-3.2, width)
    ax.set_ylim(bottom, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def plot_block_pool_states(snapshots: Sequence[PoolSnapshot], ncols: int = 2,
                           colors: Mapping[str, str] | None = None) -> Figure:
    """Several snapshots in a grid, with one colour per sequence throughout: the static stepper."""
    import matplotlib.pyplot as plt

    if not snapshots:
        raise ValueError("plot_block_pool_states needs at least one snapshot")
    colors = colors or sequence_colors(name for s in snapshots for name in s.tables)
    ncols = min(ncols, len(snapshots))
    nrows = math.ceil(len(snapshots) / ncols)
    per_row, rows = _pool_layout(snapshots[0], None)
    tables = max(len(s.tables) for s in snapshots)
    cell_h = 0.62 * (rows * _ROW_H + tables * _TABLE_H + 0.8) + 0.8
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * (0.62 * per_row * 1.3 + 2.2), nrows * cell_h),
                             squeeze=False, layout="constrained")
    for ax, snap in zip(axes.flat, snapshots, strict=False):
        plot_block_pool(snap, ax=ax, colors=colors)
    for ax in list(axes.flat)[len(snapshots):]:
        ax.axis("off")
    return fig


def block_pool_stepper(snapshots: Sequence[PoolSnapshot], colors: Mapping[str, str] | None = None) -> Any:
    """An ipywidgets stepper (back / next buttons, a slider, a play button) over ``snapshots``.

    Returns the widget to display. Nothing is drawn until it is shown in a live kernel, so pair it
    with :func:`plot_block_pool_states` for readers without one.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    if not snapshots:
        raise ValueError("block_pool_stepper needs at least one snapshot")
    colors = colors or sequence_colors(name for s in snapshots for name in s.tables)
    most = max(len(s.tables) for s in snapshots)
    last = len(snapshots) - 1
    slider = widgets.IntSlider(value=0, min=0, max=last, description="step", continuous_update=True)
    play = widgets.Play(value=0, min=0, max=last, interval=1500, description="play")
    widgets.jslink((play, "value"), (slider, "value"))
    back = widgets.Button(description="◀ back", layout=widgets.Layout(width="80px"))
    ahead = widgets.Button(description="next ▶", layout=widgets.Layout(width="80px"))
    out = widgets.Output()

    def draw(_change: object = None) -> None:
        with out:
            out.clear_output(wait=True)
            # Room for the most tables any state has: the figure keeps its height as you step.
            plot_block_pool(snapshots[slider.value], colors=colors, min_tables=most)
            plt.show()

    back.on_click(lambda _b: setattr(slider, "value", max(0, slider.value - 1)))
    ahead.on_click(lambda _b: setattr(slider, "value", min(last, slider.value + 1)))
    slider.observe(draw, names="value")
    draw()

    class BlockPoolStepper(widgets.VBox):
        def __repr__(self) -> str:  # what a notebook viewer without a kernel shows instead of the widget
            return f"<block-table stepper, {len(snapshots)} states: it needs a live kernel (see the static figure)>"

    return BlockPoolStepper([widgets.HBox([back, ahead, play, slider]), out])


def plot_fragmentation(used: Sequence[int], reserved: Mapping[str, Sequence[int]], ax: Axes | None = None,
                       unit: str = "tokens") -> Axes:
    """For each allocation scheme, one horizontal bar: slots holding tokens, then slots reserved but empty.

    Args:
        used: tokens each sequence really holds.
        reserved: scheme name -> slots that scheme reserves for each sequence (same order as ``used``).
        ax: Axes to draw on; a new figure is made when None.
        unit: what the numbers count, for the axis label.

    Returns:
        The Axes drawn on; its two bar containers are labelled ``"used"`` and ``"wasted"``, and each
        bar's end is annotated with the wasted share of what was reserved.
    """
    if not reserved:
        raise ValueError("plot_fragmentation needs at least one scheme in reserved")
    total_used = sum(used)
    names = list(reserved)
    totals = []
    for name in names:
        if len(reserved[name]) != len(used):
            raise ValueError(f"reserved[{name!r}] has {len(reserved[name])} entries but used has {len(used)}")
        if any(r < u for r, u in zip(reserved[name], used, strict=True)):
            raise ValueError(f"reserved[{name!r}] reserves fewer slots than some sequence uses")
        totals.append(sum(reserved[name]))
    ax = _new_axes(ax, (7.5, 0.7 * len(names) + 1.2))
    ys = list(range(len(names)))
    ax.barh(ys, [total_used] * len(names), color=USED_COLOR, label="used")
    wasted = [t - total_used for t in totals]
    ax.barh(ys, wasted, left=[total_used] * len(names), color=WASTE_COLOR, alpha=0.45, label="wasted")
    for y, total, waste in zip(ys, totals, wasted, strict=True):
        ax.text(total, y, f"  {waste / total:.0%} wasted" if total else "", va="center", fontsize=9)
    from matplotlib.ticker import EngFormatter

    ax.set_yticks(ys, names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # first scheme on top
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k rather than 0.2 and a 1e6 offset
    ax.set_xlabel(f"{unit} reserved in the KV cache")
    ax.margins(x=0.2)
    ax.legend(frameon=False, loc="lower right")
    return ax


def plot_request_reservations(used: Sequence[int], reserved: Mapping[str, Sequence[int]], ax: Axes | None = None,
                              max_requests: int = 24) -> Axes:
    """Per request: what each scheme reserves (bars) and what the request really uses (black tick).

    Bar containers are labelled with the scheme names; the ticks are a scatter with gid ``"used"``.
    Only the first ``max_requests`` requests are drawn.
    """
    if not reserved:
        raise ValueError("plot_request_reservations needs at least one scheme in reserved")
    n = min(len(used), max_requests)
    ax = _new_axes(ax, (max(6.0, 0.32 * n + 2), 3.2))
    width = 0.8 / len(reserved)
    for k, (name, slots) in enumerate(reserved.items()):
        xs = [i - 0.4 + (k + 0.5) * width for i in range(n)]
        ax.bar(xs, list(slots[:n]), width, label=f"reserved: {name}", alpha=0.6,
               color=SCHEME_COLORS[k % len(SCHEME_COLORS)])
    ax.scatter(range(n), list(used[:n]), marker="_", s=140, color="black", linewidths=2, zorder=3,
               label="used", gid="used")
    ax.set_xlabel("request")
    ax.set_ylabel("tokens")
    ax.set_xlim(-0.7, n - 0.3)
    ax.set_ylim(0, 1.3 * max([*used[:n], *(max(s[:n]) for s in reserved.values())], default=1))
    ax.legend(frameon=False, fontsize="small", loc="upper center", ncols=2)
    return ax
