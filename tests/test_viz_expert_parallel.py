"""The expert-parallel figures draw what they are given: bytes per rank, timelines, wire formats."""

from __future__ import annotations

from minipd.moe.expert_parallel import CommStats
from minipd.viz.expert_parallel import plot_ep_traffic, plot_layer_timeline, plot_wire_bytes


def test_traffic_labels_carry_the_measured_kib():
    stats = CommStats(calls=3, dispatch_sent_to={1: 2048, 2: 1024}, combine_received_from={1: 4096, 2: 512})
    ax = plot_ep_traffic(stats, world_size=3, experts_per_rank=4)
    texts = {t.get_text() for t in ax.texts}
    assert {"dispatch 2.0 KiB", "combine 4.0 KiB", "dispatch 1.0 KiB", "combine 0.5 KiB"} <= texts
    assert "rank 2: experts 8–11" in texts
    assert "3 layer calls" in ax.get_title()


def test_timeline_bars_start_at_zero_and_keep_durations():
    events = [("dispatch 0", 1.000, 1.002), ("experts 0", 1.002, 1.005), ("combine 0", 1.005, 1.006)]
    (ax,) = plot_layer_timeline({"serial": events})
    bars = sorted((round(p.get_x(), 6), round(p.get_width(), 6)) for p in ax.patches)
    assert bars == [(0.0, 2.0), (2.0, 3.0), (5.0, 1.0)]


def test_wire_bars_and_agreement_labels():
    rows = [{"wire": "float32", "dispatch B/row": 1024, "combine B/row": 1024, "greedy agreement": 1.0},
            {"wire": "int8", "dispatch B/row": 258, "combine B/row": 1024, "greedy agreement": 0.98}]
    ax = plot_wire_bytes(rows)
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == [258, 1024, 1024, 1024]
    assert {t.get_text() for t in ax.texts} == {"greedy 100%", "greedy 98%"}
