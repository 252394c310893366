"""The adaptive-precision benchmark: every format in the same memory under bursts, the claims checked
(preemptions and concurrency are counts, not timings, so they are asserted here), and its plots."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from minipd import LLM
from minipd.bench.adaptive import VARIANTS, format_table, measure, verdict
from minipd.viz.adaptive import plot_adaptive_timeline, plot_formats_under_load


def test_adaptive_holds_more_than_full_precision_and_loses_less_than_int4():
    results = measure("tiny-py", loads=(2, 16), output_len=48, progress=False)
    by = {(r.variant, r.num_requests): r for r in results}
    assert len(results) == 2 * len(VARIANTS)
    small = [by[(v, 2)] for v in VARIANTS]
    assert all(r.preemptions == 0 for r in small) and by[("adaptive", 2)].agreement == 1.0  # room: full precision
    full, adaptive, int4 = by[("auto", 16)], by[("adaptive", 16)], by[("int4", 16)]
    assert full.preemptions > 0 and adaptive.preemptions < full.preemptions
    assert adaptive.max_running > full.max_running and adaptive.steps < full.steps
    assert adaptive.compressions > 0 and adaptive.agreement > int4.agreement
    assert full.agreement == 1.0  # preemption recomputes, it does not change greedy tokens
    lines = verdict(results)
    assert len(lines) == 1 and lines[0].startswith("16 requests") and "missed" not in lines[0]
    table = format_table(results)
    assert "adaptive" in table and "preempted" in table
    axes = plot_formats_under_load(results)
    assert [len(ax.get_lines()) for ax in axes] == [len(VARIANTS)] * 3


def test_the_timeline_shades_the_steps_that_compress_newcomers():
    from minipd import SamplingParams
    from minipd.bench.adaptive import burst, run_staggered

    llm = LLM("tiny-py", kv_cache_dtype="adaptive", enable_prefix_caching=False, kv_cache_memory=1_500_000,
              kv_adaptive_thresholds=(0.3, 0.5))
    stats = run_staggered(llm, burst(llm.tokenizer, 10), SamplingParams(max_tokens=48, ignore_eos=True), every=4)
    assert not stats[0].kv_compressing and stats[0].num_compressed_running == 0  # the first one: full precision
    assert any(s.kv_compressing for s in stats) and stats[-1].kv_format_switches >= 2  # on, and off again
    assert max(s.num_running for s in stats) > 3 and llm.engine.core.scheduler.num_preemptions == 0
    ax = plot_adaptive_timeline(stats, (0.3, 0.5))
    shaded = [p for p in ax.patches if p.get_alpha() == 0.12]
    assert len(shaded) == sum(s.kv_compressing for s in stats)
