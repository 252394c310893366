"""minipd.viz.interference: the decoding requests' gaps, the long prompt's prefill steps, and their numbers."""

from __future__ import annotations

import math

import matplotlib
import pytest

matplotlib.use("Agg")

from minipd.outputs import RequestMetrics, RequestOutput
from minipd.sim.batching import StepRecord, Timeline, exact_params, run_continuous
from minipd.viz.interference import interference_summary, plot_interference, prefill_spans


def output(token_times: list[float], arrival: float = 0.0) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_token_time=token_times[0], token_times=token_times)
    return RequestOutput("0", None, [1], list(range(len(token_times))), "", "length", metrics)


def timeline(chunked: bool) -> Timeline:
    """r0 and r1 decode every 10 ms; r2 (the long prompt) arrives at step 2 and is prefilled in one 100 ms step,
    or (chunked) in two 30 ms steps."""
    durations = [0.01, 0.01, 0.03, 0.03, 0.01, 0.01] if chunked else [0.01, 0.01, 0.1, 0.01, 0.01]
    long_phases = (["", "", "prefill", "prefill", "decode", "decode"] if chunked
                   else ["", "", "prefill", "decode", "decode"])
    long_tokens = [0, 0, 50, 50, 1, 1] if chunked else [0, 0, 100, 1, 1]
    steps, start = [], 0.0
    for i, (d, phase, n) in enumerate(zip(durations, long_phases, long_tokens, strict=True)):
        phases = {"r0": "decode", "r1": "decode"} | ({"r2": phase} if phase else {})
        tokens = {"r0": 1, "r1": 1} | ({"r2": n} if n else {})
        emitted = {"r0", "r1"} | ({"r2"} if phase == "decode" or (phase == "prefill" and i == long_phases.index(
            "decode") - 1) else set())
        steps.append(StepRecord(i, start, d, phases, tokens, frozenset(emitted)))
        start += d
    ends = [s.start + s.duration for s in steps]
    long_first = next(s.start + s.duration for s in steps if "r2" in s.emitted)
    outputs = [output(ends), output(ends), output([long_first, *ends[-2:]], arrival=steps[2].start)]
    return Timeline("continuous", ["r0", "r1", "r2"], ["0", "1", "2"], [0, 0, 2], steps, outputs)


def test_summary_separates_the_prefill_gaps_from_the_steady_ones():
    one = interference_summary(timeline(chunked=False), label="budget 2048")
    assert one.label == "budget 2048"
    assert one.chunks == (100,)
    assert one.longest_gap == pytest.approx(0.1)
    assert one.prefill_gap == pytest.approx(0.1)
    assert one.steady_gap == pytest.approx(0.01)
    assert one.spike == pytest.approx(10)
    assert one.long_ttft == pytest.approx(0.1)
    two = interference_summary(timeline(chunked=True))
    assert two.label == "continuous"
    assert two.chunks == (50, 50)
    assert two.longest_gap == pytest.approx(0.03)
    assert two.prefill_gap == pytest.approx(0.03)
    assert two.long_ttft == pytest.approx(0.06)


def test_plot_shades_the_prefill_steps_and_draws_each_decoding_request():
    runs = {"budget 2048": timeline(chunked=False), "budget 64": timeline(chunked=True)}
    axes = plot_interference(runs)
    assert len(axes) == 2
    for ax, (label, tl) in zip(axes, runs.items(), strict=True):
        spans = [p for p in ax.patches if p.get_gid() == "prefill"]
        assert len(spans) == len(prefill_spans(tl, -1)) == len(interference_summary(tl).chunks)
        lines = {line.get_gid(): line for line in ax.get_lines()}
        assert set(lines) == {"r0", "r1", "arrival"}  # the long prompt itself is not drawn
        # The arrival line sits at the start of step 2, in ms.
        assert lines["arrival"].get_xdata()[0] == pytest.approx(20)
        # A plateau per gap: the first gap twice (where the line starts), then one value per token.
        ys = lines["r0"].get_ydata()
        assert max(ys) == pytest.approx(100 if label == "budget 2048" else 30)
        assert ax.get_title(loc="left").startswith(f"{label}: longest gap")
    assert "100 ms = 10.0×" in axes[0].get_title(loc="left")
    with pytest.raises(ValueError):
        plot_interference({})


def test_summary_fails_without_a_prefill_of_the_long_request():
    tl = timeline(chunked=False)
    with pytest.raises(ValueError, match="no prefill step"):
        interference_summary(tl, long_index=0)


def test_on_the_engine_a_whole_prompt_is_one_prefill_step():
    from minipd import LLM
    from minipd.bench import make_workload

    llm = LLM("tiny-py", enable_prefix_caching=False, num_kv_blocks=64, max_num_batched_tokens=2048)
    vocab = llm.config.vocab_size
    prompts = make_workload(2, (8, 8), (1, 1), vocab, seed=1).prompts
    prompts += make_workload(1, (200, 200), (1, 1), vocab, seed=2).prompts
    tl = run_continuous(llm, prompts, exact_params([8, 8, 2]), arrivals=[0, 0, 3])
    summary = interference_summary(tl)
    assert summary.chunks == (200,)
    assert not math.isnan(summary.steady_gap)
    assert summary.longest_gap >= summary.prefill_gap > 0
    axes = plot_interference({"engine": tl})
    assert len([p for p in axes[0].patches if p.get_gid() == "prefill"]) == 1
