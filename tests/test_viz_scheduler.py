"""minipd.viz.scheduler draws exactly the steps, tokens and latencies it is given."""

from __future__ import annotations

import matplotlib
import pytest
from helpers import bars, by_gid

matplotlib.use("Agg")


from minipd.engine.stats import StepStats
from minipd.outputs import RequestMetrics, RequestOutput
from minipd.sim.batching import PHASES, LoadPoint, StepRecord, Timeline
from minipd.viz.scheduler import (
    phase_codes,
    plot_kv_blocks,
    plot_schedule_timeline,
    plot_step_tokens,
    plot_throughput_latency,
    plot_token_gaps,
)


@pytest.fixture
def timeline() -> Timeline:
    """r0 decodes throughout; r1 arrives at step 1, is prefilled in two chunks, then preempted and redone."""
    steps = [
        StepRecord(0, 0.0, 0.01, {"r0": "prefill"}, {"r0": 5}, frozenset({"r0"})),
        StepRecord(1, 0.01, 0.01, {"r0": "decode", "r1": "prefill"}, {"r0": 1, "r1": 3}),
        StepRecord(2, 0.02, 0.01, {"r0": "decode", "r1": "prefill"}, {"r0": 1, "r1": 2}, frozenset({"r0", "r1"})),
        StepRecord(3, 0.03, 0.01, {"r0": "decode", "r1": "preempted"}, {"r0": 1}, frozenset({"r0"})),
        StepRecord(4, 0.04, 0.01, {"r0": "done", "r1": "prefill"}, {"r1": 6}, frozenset({"r1"})),
        StepRecord(5, 0.05, 0.01, {"r0": "done", "r1": "stalled"}, {}),
    ]
    return Timeline("continuous", ["r0", "r1"], ["0", "1"], [0, 1], steps)


def stats(prefill: list[int], decode: list[int], preempt: list[int], used: list[int], total: int = 10
          ) -> list[StepStats]:
    return [StepStats(start_time=i * 0.01, duration=0.002 * (i + 1), num_prefill_tokens=p, num_decode_tokens=d,
                      num_running=1, num_waiting=0, kv_blocks_used=u, kv_blocks_free=total - u, prefix_hit_rate=0.0,
                      num_preemptions=x)
            for i, (p, d, x, u) in enumerate(zip(prefill, decode, preempt, used, strict=True))]


def test_timeline_cells_are_the_recorded_phases(timeline):
    ax = plot_schedule_timeline(timeline)
    codes = ax.images[0].get_array().tolist()
    assert codes == phase_codes(timeline)
    assert [[PHASES[c] for c in row] for row in codes] == [
        ["prefill", "decode", "decode", "decode", "done", "done"],
        ["", "prefill", "prefill", "preempted", "prefill", "stalled"],
    ]
    # Prefill cells carry their chunk sizes, in row order.
    assert [t.get_text() for t in ax.texts] == ["5", "3", "2", "6"]
    assert [t.get_position() for t in ax.texts] == [(0, 0), (1, 1), (2, 1), (4, 1)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["r0", "r1"]
    assert ax.get_title() == "continuous batching: 6 steps"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["prefill (chunk)", "decode", "stalled (no budget)", "preempted"]


def test_timeline_token_labels_can_be_turned_off(timeline):
    ax = plot_schedule_timeline(timeline, show_tokens=False, title="mine")
    assert len(ax.texts) == 0 and ax.get_title() == "mine"


def test_step_tokens_stack_prefill_and_decode(timeline):
    s = stats([5, 3, 0, 6], [0, 1, 2, 0], [0, 0, 1, 0], [1, 2, 3, 2])
    ax = plot_step_tokens(s)
    assert [b.get_height() for b in bars(ax, "prefill")] == [5, 3, 0, 6]
    assert [b.get_height() for b in bars(ax, "decode")] == [0, 1, 2, 0]
    assert [b.get_y() for b in bars(ax, "decode")] == [5, 3, 0, 6]  # stacked on the prefill
    assert by_gid(ax, "preemptions").get_offsets().tolist() == [[2, 2]]
    duration = by_gid(ax.duration_axes, "duration")
    assert duration.get_ydata().tolist() == pytest.approx([2, 4, 6, 8])


def test_step_tokens_without_duration_has_no_twin_axis():
    ax = plot_step_tokens(stats([1], [0], [0], [1]), show_duration=False)
    assert not hasattr(ax, "duration_axes")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["prefill", "decode"]


def test_kv_blocks_follow_the_pool():
    ax = plot_kv_blocks(stats([4, 0, 0], [0, 2, 1], [0, 1, 0], [3, 9, 5], total=10))
    assert by_gid(ax, "used").get_ydata().tolist() == [3, 9, 5]
    assert by_gid(ax, "capacity").get_ydata().tolist() == [10, 10, 10]
    assert by_gid(ax, "preemptions").get_offsets().tolist() == [[1, 9]]


def output(token_times: list[float]) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, first_token_time=token_times[0], token_times=token_times)
    return RequestOutput("0", None, [1], list(range(len(token_times))), "", "length", metrics)


def test_token_gaps_in_ms():
    ax = plot_token_gaps({"budget 2048": output([0.1, 0.11, 0.31, 0.32]), "budget 64": output([0.1, 0.15])})
    assert by_gid(ax, "budget 2048").get_ydata().tolist() == pytest.approx([10, 200, 10])
    assert by_gid(ax, "budget 2048").get_xdata().tolist() == [1, 2, 3]
    assert by_gid(ax, "budget 64").get_ydata().tolist() == pytest.approx([50])


def test_throughput_latency_points():
    series = {"max_num_seqs": [LoadPoint("1", 100.0, 0.5, 0.010), LoadPoint("4", 300.0, 0.2, 0.020)],
              "budget": [LoadPoint("16", 200.0, 0.4, 0.015)]}
    left, right = plot_throughput_latency(series)
    tpot = by_gid(left, "max_num_seqs/tpot")
    assert tpot.get_xdata().tolist() == pytest.approx([10, 20])
    assert tpot.get_ydata().tolist() == [100, 300]
    assert by_gid(right, "max_num_seqs/ttft").get_xdata().tolist() == pytest.approx([500, 200])
    assert by_gid(right, "budget/ttft").get_xdata().tolist() == pytest.approx([400])
    assert [t.get_text() for t in left.texts] == ["1", "4", "16"]
    # The two series label on opposite sides of their points, so close points do not collide.
    assert [t.get_va() for t in left.texts] == ["bottom", "bottom", "top"]


def test_empty_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="at least one"):
        plot_step_tokens([])
    with pytest.raises(ValueError, match="at least one"):
        plot_kv_blocks([])
    with pytest.raises(ValueError, match="at least one"):
        plot_throughput_latency({"a": []})
    with pytest.raises(ValueError, match="at least one"):
        plot_schedule_timeline(Timeline("static", ["r0"], ["0"], [0]))


def test_explorer_redraws_with_the_slider_values():
    pytest.importorskip("ipywidgets")
    from minipd.viz.scheduler import scheduler_explorer

    calls = []
    box = scheduler_explorer(lambda b, c: calls.append((b, c)), budgets=[16, 64, 2048], caps=[1, 4], budget=64)
    budget_slider, cap_slider = box.children[0].children
    assert calls == [(64, 4)]  # drawn once with the starting values
    assert list(budget_slider.options) == [16, 64, 2048]
    cap_slider.value = 1
    budget_slider.value = 16
    assert calls == [(64, 4), (64, 1), (16, 1)]
    assert "needs a live kernel" in repr(box) and budget_slider.layout.width == "480px"
    with pytest.raises(ValueError, match="at least one"):
        scheduler_explorer(lambda b, c: None, budgets=[], caps=[1])


@pytest.mark.parametrize("longest_first", [True, False])
def test_timelines_on_shared_axes_each_show_every_step(timeline, longest_first):
    """With sharex, an image's extent resets the shared limits: the longer timeline must not be clipped."""
    import matplotlib.pyplot as plt

    short = Timeline("static", timeline.labels, timeline.request_ids, timeline.arrivals, timeline.steps[:4])
    _, axes = plt.subplots(2, 1, sharex=True)
    order = (timeline, short) if longest_first else (short, timeline)
    for ax, tl in zip(axes, order, strict=True):
        plot_schedule_timeline(tl, ax=ax)
    for ax in axes:
        assert ax.get_xlim() == (-0.5, timeline.num_steps - 0.5)  # 6 steps visible on both
    plt.close("all")
