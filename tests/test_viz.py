"""minipd.viz draws exactly the metrics it is given, and importing minipd does not pull in matplotlib."""

from __future__ import annotations

import subprocess
import sys

import matplotlib
import pytest
from helpers import bars, by_gid

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from minipd.outputs import RequestMetrics, RequestOutput
from minipd.viz import latency_table, plot_latency_vs, plot_token_timeline, plot_ttft_tpot


def fake_output(request_id: str, arrival: float, scheduled: float | None, token_times: list[float],
                prompt_len: int = 4) -> RequestOutput:
    """A finished request whose timestamps are chosen by hand (perf_counter-like seconds)."""
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled,
                             first_token_time=token_times[0] if token_times else None,
                             finish_time=token_times[-1] if token_times else None,
                             token_times=list(token_times), prefill_tokens=prompt_len)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(range(prompt_len)),
                         token_ids=list(range(len(token_times))), text="", finish_reason="length",
                         metrics=metrics)


@pytest.fixture
def outputs() -> list[RequestOutput]:
    # Times start at 100 s, like perf_counter, so the plots must subtract the earliest arrival.
    return [
        fake_output("0", 100.000, 100.001, [100.010, 100.012, 100.014, 100.016]),  # TTFT 10 ms, TPOT 2 ms
        fake_output("1", 100.000, 100.016, [100.030, 100.035, 100.040]),           # TTFT 30 ms, TPOT 5 ms
        fake_output("2", 100.005, None, [100.025]),                                 # TTFT 20 ms, no TPOT
    ]


def test_ttft_tpot_bar_heights_are_the_metrics_in_ms(outputs):
    ax = plot_ttft_tpot(outputs)
    ttft = [bar.get_height() for bar in bars(ax, "TTFT")]
    tpot = [bar.get_height() for bar in bars(ax, "TPOT")]
    assert ttft == pytest.approx([10.0, 30.0, 20.0])
    assert tpot == pytest.approx([2.0, 5.0, 0.0])  # one token: no TPOT, an empty bar
    assert [t.get_text() for t in ax.texts] == ["10.0", "30.0", "20.0", "2.0", "5.0", "n/a"]
    assert ax.get_ylim()[1] > 30.0  # headroom above the tallest bar for its label
    assert [t.get_text() for t in ax.get_xticklabels()] == ["req 0", "req 1", "req 2"]


def test_ttft_tpot_draws_on_given_axes(outputs):
    _, ax = plt.subplots()
    assert plot_ttft_tpot(outputs, ax=ax) is ax


def test_token_timeline_places_every_token(outputs):
    ax = plot_token_timeline(outputs)
    xy = by_gid(ax, "tokens").get_offsets()
    # ms since the earliest arrival (100.000 s), one row per request in the given order.
    expected = [(10, 0), (12, 0), (14, 0), (16, 0), (30, 1), (35, 1), (40, 1), (25, 2)]
    assert [tuple(p) for p in xy.tolist()] == [pytest.approx(p) for p in expected]
    assert by_gid(ax, "arrival").get_offsets().tolist() == [pytest.approx(p) for p in [(0, 0), (0, 1), (5, 2)]]
    assert by_gid(ax, "first_token").get_offsets()[:, 0].tolist() == pytest.approx([10, 30, 25])


def test_token_timeline_bars_split_ttft_into_waiting_and_prefill(outputs):
    ax = plot_token_timeline(outputs)
    waiting, prefill = bars(ax, "waiting"), bars(ax, "prefill")
    # Request 2 has no first_scheduled_time, so it counts as scheduled on arrival: no wait.
    assert [b.get_x() for b in waiting] == pytest.approx([0, 0, 5])
    assert [b.get_width() for b in waiting] == pytest.approx([1, 16, 0])
    assert [b.get_x() for b in prefill] == pytest.approx([1, 16, 5])
    assert [b.get_width() for b in prefill] == pytest.approx([9, 14, 20])
    # Waiting plus prefill is the TTFT.
    ttft = [w.get_width() + p.get_width() for w, p in zip(waiting, prefill, strict=True)]
    assert ttft == pytest.approx([out.metrics.ttft * 1e3 for out in outputs])
    # First request on top.
    bottom, top = ax.get_ylim()
    assert bottom > top


def test_latency_vs_takes_median_of_repeats(outputs):
    fast, slow, _ = outputs
    ax = plot_latency_vs([1, 2], [fast, [fast, slow, slow]], xlabel="prompt tokens")
    assert by_gid(ax, "ttft").get_ydata().tolist() == pytest.approx([10, 30])
    assert by_gid(ax, "tpot").get_ydata().tolist() == pytest.approx([2, 5])
    assert ax.get_xlabel() == "prompt tokens"
    with pytest.raises(ValueError, match="x has 1 values"):
        plot_latency_vs([1], [fast, slow], xlabel="n")


def test_empty_input_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one"):
        plot_token_timeline([])
    with pytest.raises(ValueError, match="at least one"):
        plot_ttft_tpot([])


def test_latency_table_rounds_to_hundredths(outputs):
    lines = latency_table(outputs).splitlines()
    assert len(lines) == 4
    assert lines[1].split() == ["0", "4", "4", "10.00", "2.00"]
    assert lines[3].split() == ["2", "4", "1", "20.00", "n/a"]


def test_import_minipd_does_not_import_matplotlib():
    code = "import sys, minipd, minipd.viz; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
