"""The decode-programs picture: every block-table entry and every pool cell labelled as the kernel reads it."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import torch

from minipd.viz.paged import plot_decode_programs


def test_each_sequence_block_and_program_is_labelled():
    tables = torch.tensor([[3, 0, 0], [1, 4, 2]])
    fig = plot_decode_programs(tables, torch.tensor([5, 10]), num_blocks=6, block_size=4, kv_heads=2)
    top, bottom = fig.axes
    # Seq 0 holds 5 tokens (2 blocks: 3, 0), seq 1 holds 10 (3 blocks: 1, 4, 2); padding is never drawn.
    assert [t.get_text() for t in top.texts] == ["→ 3", "→ 0", "→ 1", "→ 4", "→ 2"]
    cells = [t.get_text() for t in bottom.texts]
    assert len(cells) == 6 * 2
    assert cells.count("free") == 2 * 1  # block 5 only
    assert "(0,0)" in cells and "(1,1)" in cells and "(0,1)" in cells
