"""minipd.viz.kv draws exactly the pool state and the reservations it is given."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.colors import to_rgba

from minipd.kv.block_manager import BlockAllocation, BlockManager
from minipd.viz.kv import (
    CACHED_COLOR,
    block_pool_stepper,
    plot_block_pool,
    plot_block_pool_states,
    plot_fragmentation,
    plot_request_reservations,
    sequence_colors,
    snapshot_pool,
)


def admit(bm: BlockManager, tokens: list[int]) -> BlockAllocation:
    alloc = BlockAllocation()
    assert bm.allocate(alloc, len(tokens), bm.find_cached_prefix(tokens))
    bm.register_full_blocks(alloc, tokens, len(tokens))
    return alloc


@pytest.fixture
def pool():
    """Block size 4: A holds 10 tokens, B shares A's first block and has 6; C came and went."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = admit(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])   # blocks 0, 1, 2 (2 holds 2 tokens)
    b = admit(bm, [1, 2, 3, 4, 0, 0])               # shares block 0, then block 3 with 2 tokens
    c = admit(bm, [20, 21, 22, 23, 24])             # block 4 full and cached, block 5 partial
    bm.free_blocks(c)
    return bm, {"A": (a, 10), "B": (b, 6)}


def patches_by_gid(ax, prefix: str) -> dict[str, object]:
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def test_snapshot_copies_tables_counts_and_free_order(pool):
    bm, seqs = pool
    snap = snapshot_pool(bm, seqs, "two sequences")
    assert snap.tables == {"A": (0, 1, 2), "B": (0, 3)}
    assert snap.ref_counts[:6] == (2, 1, 1, 1, 0, 0)
    assert snap.cached[4] and not snap.cached[5]
    # The partial block 5 goes to the front of the free list, the cached block 4 to the back.
    assert snap.free_order[0] == 5 and snap.free_order[-1] == 4
    assert [snap.tokens_in_block(b) for b in range(6)] == [4, 4, 2, 2, 4, 0]
    # Later changes to the block manager do not reach the snapshot.
    bm.free_blocks(seqs["A"][0])
    assert snap.tables["A"] == (0, 1, 2)


def test_pool_plot_colours_slots_by_owner(pool):
    bm, seqs = pool
    snap = snapshot_pool(bm, seqs)
    colors = sequence_colors(["A", "B"])
    ax = plot_block_pool(snap, colors=colors)
    slots = patches_by_gid(ax, "slot:")
    filled = {}
    for gid in slots:
        _, block, _ = gid.split(":")
        filled[int(block)] = filled.get(int(block), 0) + 1
    assert filled == {0: 4, 1: 4, 2: 2, 3: 2, 4: 4}  # block 5 is free and empty: no slot drawn
    assert slots["slot:1:0"].get_facecolor() == to_rgba(colors["A"])
    assert slots["slot:3:1"].get_facecolor() == to_rgba(colors["B"])
    assert slots["slot:4:0"].get_facecolor() == to_rgba(CACHED_COLOR)
    # The shared block is striped: one stripe per owner in each slot.
    stripes = [p for p in ax.patches if p.get_x() == slots["slot:0:0"].get_x() and p.get_width() == 0.25
               and p.get_y() < 1]
    assert {p.get_facecolor() for p in stripes} == {to_rgba(colors["A"]), to_rgba(colors["B"])}
    assert len(patches_by_gid(ax, "block:")) == 8


def test_pool_plot_writes_block_tables_and_labels(pool):
    bm, seqs = pool
    ax = plot_block_pool(snapshot_pool(bm, seqs, "caption here"))
    table_texts = {t.get_gid(): t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("table:")}
    assert table_texts == {"table:A:0": "0", "table:A:1": "1", "table:A:2": "2", "table:B:0": "0", "table:B:1": "3"}
    labels = [t.get_text() for t in ax.texts]
    assert "ref 2" in labels and "next 1" in labels
    assert ax.get_title(loc="left").startswith("caption here\n4 used, 4 free (1 still cached) of 8 blocks")


def test_static_states_and_stepper(pool):
    bm, seqs = pool
    snaps = [snapshot_pool(bm, {}, "empty"), snapshot_pool(bm, seqs, "full")]
    fig = plot_block_pool_states(snaps, ncols=2)
    assert [ax.get_title(loc="left").split("\n")[0] for ax in fig.axes] == ["empty", "full"]
    stepper = block_pool_stepper(snaps)
    assert "2 states" in repr(stepper)
    with pytest.raises(ValueError, match="at least one"):
        plot_block_pool_states([])


def test_fragmentation_bars_are_used_and_wasted_totals():
    used = [10, 30, 5]
    reserved = {"contiguous": [64, 64, 64], "paged 16": [16, 32, 16]}
    ax = plot_fragmentation(used, reserved)
    bars = {c.get_label(): [b.get_width() for b in c] for c in ax.containers}
    assert bars == {"used": [45, 45], "wasted": [192 - 45, 64 - 45]}
    assert [t.get_text().strip() for t in ax.texts] == ["77% wasted", "30% wasted"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["contiguous", "paged 16"]
    with pytest.raises(ValueError, match="fewer slots"):
        plot_fragmentation(used, {"too small": [8, 30, 5]})
    with pytest.raises(ValueError, match="entries"):
        plot_fragmentation(used, {"short": [64]})


def test_request_reservations_plot_each_request():
    used = [10, 30, 5]
    reserved = {"contiguous": [64, 64, 64], "paged 16": [16, 32, 16]}
    ax = plot_request_reservations(used, reserved, max_requests=2)
    heights = {c.get_label(): [b.get_height() for b in c] for c in ax.containers}
    assert heights == {"reserved: contiguous": [64, 64], "reserved: paged 16": [16, 32]}
    ticks = next(c for c in ax.collections if c.get_gid() == "used")
    assert ticks.get_offsets().tolist() == [[0, 10], [1, 30]]


def test_a_pool_drawing_keeps_its_size_when_told_how_many_tables_to_expect(pool):
    """The stepper draws every state with room for the most tables, so its figure keeps one height."""
    import matplotlib.pyplot as plt

    bm, seqs = pool
    empty, full = snapshot_pool(bm, {}, "empty"), snapshot_pool(bm, seqs, "full")
    sizes = [plot_block_pool(s, min_tables=2).figure.get_size_inches().tolist() for s in (empty, full)]
    limits = [plt.figure(i).axes[0].get_ylim() for i in plt.get_fignums()[-2:]]
    assert sizes[0] == sizes[1] and limits[0] == limits[1]
    assert plot_block_pool(empty).figure.get_size_inches()[1] < sizes[0][1]  # without it: shorter
    plt.close("all")
