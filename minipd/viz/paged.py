"""A picture of the paged decode kernel's work: block tables, and which program reads which block.

matplotlib is imported inside the function: ``import minipd`` never pays for it.
"""

from __future__ import annotations

from typing import Any

import torch


def plot_decode_programs(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int,
                         kv_heads: int) -> Any:
    """Two panels: each sequence's block table (logical block → physical block, filled as far as the
    sequence's tokens go), and the pool, each block cell labelled with the (sequence, KV head) program
    of the decode kernel that reads it (``free`` where none does).

    Returns the figure. Block-table cells are texts ``"→ <physical id>"``; pool cells ``"(s,h)"`` or ``"free"``.
    """
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    lens = context_lens.tolist()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.6), gridspec_kw={"height_ratios": [len(lens), kv_heads]})
    owner = {}  # physical block -> (sequence, tokens it holds)
    for s, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            phys = int(block_tables[s, b])
            held = min(block_size, n - b * block_size)
            owner[phys] = (s, held)
            top.add_patch(plt.Rectangle((b, s), 0.95 * held / block_size, 0.9, color=colors[s % len(colors)]))
            top.add_patch(plt.Rectangle((b, s), 0.95, 0.9, fill=False, ec="k", lw=0.6))
            top.text(b + 0.47, s + 0.45, f"→ {phys}", ha="center", va="center", fontsize=8)
    width = block_tables.shape[1]
    top.set(xlim=(0, width), ylim=(len(lens), 0), yticks=[s + 0.45 for s in range(len(lens))],
            yticklabels=[f"seq {s} ({n} tok)" for s, n in enumerate(lens)], xlabel="logical block",
            title="block tables: logical block → physical block (fill = slots in use)")
    top.set_xticks([b + 0.47 for b in range(width)], range(width))
    for phys in range(num_blocks):
        for h in range(kv_heads):
            if phys in owner:
                s, _ = owner[phys]
                face, label, alpha = colors[s % len(colors)], f"({s},{h})", 1.0 if h == 0 else 0.55
            else:
                face, label, alpha = "lightgrey", "free", 1.0
            bottom.add_patch(plt.Rectangle((phys, h), 0.95, 0.9, color=face, alpha=alpha))
            bottom.text(phys + 0.47, h + 0.45, label, ha="center", va="center", fontsize=7)
    bottom.set(xlim=(0, num_blocks), ylim=(kv_heads, 0), yticks=[h + 0.45 for h in range(kv_heads)],
               yticklabels=[f"kv head {h}" for h in range(kv_heads)], xlabel="physical block",
               title="the pool: cell = (program's sequence, KV head) reading it")
    bottom.set_xticks([p + 0.47 for p in range(num_blocks)], range(num_blocks))
    fig.tight_layout()
    return fig
