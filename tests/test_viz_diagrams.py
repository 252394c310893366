"""The conceptual diagrams: every box is drawn and named, and the highlighted ones are the chapter's."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.colors import to_rgba

from minipd.viz.diagrams import (
    CHAPTER_PARTS,
    ENGINE_PARTS,
    GREY,
    GROUP_COLORS,
    REQUEST_STAGES,
    engine_parts,
    plot_engine_map,
    plot_paged_kv,
    plot_prefill_decode_flow,
    plot_request_path,
)


def boxes(ax, prefix: str) -> dict:
    """The patches whose gid starts with ``prefix:``, by the rest of the gid."""
    return {p.get_gid().removeprefix(prefix + ":"): p for p in ax.patches
            if p.get_gid() and p.get_gid().startswith(prefix + ":")}


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def is_grey(patch) -> bool:
    return patch.get_facecolor() == to_rgba(GREY)


def test_engine_map_draws_every_part_with_its_title_and_chapter():
    ax = plot_engine_map()
    parts = boxes(ax, "part")
    assert set(parts) == set(ENGINE_PARTS)
    drawn = texts(ax)
    for name, part in ENGINE_PARTS.items():
        assert part.title in drawn, name
        assert f"ch{part.chapter}" in drawn, name
    # Without a highlight every box is in its group's colour.
    for name, patch in parts.items():
        assert patch.get_facecolor() == to_rgba(GROUP_COLORS[ENGINE_PARTS[name].group]), name
    assert "every part" in ax.get_title(loc="left")


@pytest.mark.parametrize("key", ["03", "ch03", "3", "ch3"])
def test_engine_map_colours_only_the_chapters_parts(key):
    ax = plot_engine_map(key)
    parts = boxes(ax, "part")
    coloured = {name for name, patch in parts.items() if not is_grey(patch)}
    assert coloured == {"block manager", "KV pool", "attention"}
    assert ax.get_title(loc="left") == "chapter 03 builds the parts in colour"


def test_engine_map_takes_part_names_and_mixes():
    ax = plot_engine_map(["scheduler", "07"])
    coloured = {name for name, patch in boxes(ax, "part").items() if not is_grey(patch)}
    assert coloured == {"scheduler", "MLP / MoE", "expert parallel"}


def test_engine_map_chapters_name_real_parts_and_unknown_names_fail():
    for chapter, names in CHAPTER_PARTS.items():
        assert set(names) <= set(ENGINE_PARTS), chapter
        assert engine_parts(chapter) == set(names)
    assert engine_parts("05") == {"prefill worker", "KV transfer", "decode worker"}
    assert engine_parts("3b") == engine_parts("ch03b") == {"attention", "KV pool"}
    with pytest.raises(ValueError, match="unknown part or chapter"):
        engine_parts("09")
    with pytest.raises(ValueError, match="unknown part or chapter"):
        plot_engine_map(["scheduler", "gpu"])


def test_request_path_has_every_stage_in_order_and_a_preemption_path():
    ax = plot_request_path()
    stages = boxes(ax, "stage")
    assert list(stages) == [name for name, *_ in REQUEST_STAGES]
    drawn = texts(ax)
    for _, title, detail, _ in REQUEST_STAGES:
        assert title in drawn and detail in drawn
    # Top row left to right up to prefill, bottom row right to left from decode.
    xs = {name: p.get_x() for name, p in stages.items()}
    ys = {name: p.get_y() for name, p in stages.items()}
    assert xs["prompt"] < xs["tokenize"] < xs["waiting"] < xs["prefill"]
    assert xs["decode"] > xs["sample"] > xs["stream"] > xs["finished"]
    assert ys["prefill"] > ys["decode"]
    assert any(g and g == "preemption" for g in (p.get_gid() for p in ax.patches))
    assert any("preempted" in t for t in drawn)
    assert any("chunk" in t for t in drawn)


def test_prefill_decode_flow_shows_shapes_cache_traffic_and_bounds():
    ax = plot_prefill_decode_flow(prompt_tokens=5)
    drawn = " | ".join(texts(ax))
    for piece in ("ids [N]", "ids [1]", "hidden [N, d]", "hidden [1, d]", "logits [N, V]", "logits [1, V]",
                  "compute-bound", "memory-bound", "TTFT", "TPOT"):
        assert piece in drawn, piece
    gids = [p.get_gid() for p in ax.patches]
    # Prefill writes the K/V of all N prompt tokens; decode reads the N + 2 cached ones and writes one.
    assert gids.count("prefill:write") == 5
    assert gids.count("decode:read") == 7
    assert gids.count("decode:write") == 1
    assert "prefill:read" not in gids
    with pytest.raises(ValueError):
        plot_prefill_decode_flow(prompt_tokens=12)


def test_paged_kv_maps_every_logical_block_and_marks_shared_and_free_blocks():
    ax = plot_paged_kv()  # A: [7, 2, 9], B: [7, 4], C: [0, 10] in a pool of 12
    physical = boxes(ax, "physical")
    assert len(physical) == 12
    assert len(boxes(ax, "logical")) == 3 + 2 + 2
    maps = boxes(ax, "map")
    assert set(maps) == {"A:0", "A:1", "A:2", "B:0", "B:1", "C:0", "C:1"}
    assert [p.get_hatch() for b, p in physical.items() if p.get_hatch()] == ["///"]
    assert physical["7"].get_hatch() == "///"
    free = [b for b, p in physical.items() if p.get_facecolor() == to_rgba("white")]
    assert sorted(map(int, free)) == [1, 3, 5, 6, 8, 11]
    drawn = texts(ax)
    assert drawn.count("free") == 6
    assert "ref 2" in drawn
    assert "sequence A: 37 tokens\nblock table [7, 2, 9]" in drawn


def test_paged_kv_takes_other_tables_and_checks_them():
    ax = plot_paged_kv({"x": (5, [3]), "y": (20, [3, 1])}, num_blocks=4, block_size=16)
    physical = boxes(ax, "physical")
    assert physical["3"].get_hatch() == "///" and not physical["1"].get_hatch()
    assert texts(ax).count("free") == 2
    with pytest.raises(ValueError, match="need 2 blocks"):
        plot_paged_kv({"x": (20, [0])}, num_blocks=4)
    with pytest.raises(ValueError, match="block ids"):
        plot_paged_kv({"x": (5, [9])}, num_blocks=4)


def test_the_compressed_cache_diagrams_show_what_they_say():
    from minipd.viz.kv_diagrams import plot_adaptive_pages, plot_kivi_residual, plot_scale_sharing

    axes = plot_scale_sharing(tokens=8, channels=8, group=4)
    groups = [len(set(ax.images[0].get_array().ravel().tolist())) for ax in axes]
    assert groups == [1, 8, 8, 10]  # 16 groups drawn in a palette of 10 colours: every colour in use
    assert [ax.get_title().split(":")[1].strip() for ax in axes] == ["1 scale", "8 scales", "8 scales", "16 scales"]
    ax = plot_kivi_residual(blocks=4, block_size=4, filled=3)
    empty = [p for p in ax.patches if p.get_facecolor()[:3] == (1.0, 1.0, 1.0)]
    assert len(empty) == 1  # one slot of the filling block still to write
    ax = plot_adaptive_pages(usage=(0.1, 0.6, 0.4, 0.2), thresholds=(0.3, 0.5))
    colours = [p.get_facecolor()[:3] for p in ax.patches]
    blue, purple = colours[0], colours[1]
    assert colours == [blue, purple, purple, blue]  # compress above 50%, keep compressing until under 30%


def test_the_resilience_diagram_has_its_three_panels():
    from minipd.viz.pd_diagrams import plot_pd_resilience

    axes = plot_pd_resilience()
    assert [ax.get_title().split(":")[0] for ax in axes] == ["recovery", "snapshots", "backpressure"]
