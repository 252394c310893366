"""The deployment guide: each branch of the article's selection guide, from the numbers that decide it."""

from __future__ import annotations

import math

from minipd.serve.guide import LatencyCurve, recommend


def test_goodput_from_a_measured_curve_interpolates_where_an_slo_is_crossed():
    curve = LatencyCurve((2, 8, 16, 32), (20, 30, 80, 400), (5, 6, 9, 20))
    # At 16 req/s the worse ratio to an SLO is 9/15 (TPOT); at 32, 400/200 (TTFT): 1 is crossed 2/7 of the way.
    assert math.isclose(curve.goodput(200, 15), 16 + 16 * (1 - 0.6) / (2 - 0.6))
    assert curve.goodput(1000, 100) == 32  # never missed: the highest rate measured
    assert curve.goodput(10, 100) == 0  # even the lowest misses


def test_each_rule_of_the_guide():
    short = recommend("llama-3-8b", 512, 128, rate=4)
    assert short.deployment == "one dense instance" and short.predicted_goodput is None
    assert recommend("llama-3-8b", 16000, 256, rate=2).deployment == "PD split + KV compression"
    crowded = recommend("llama-3-8b", 2000, 500, rate=40)  # short prompts, but their cache overflows the device
    assert crowded.deployment == "PD split + KV compression" and "does not fit" in crowded.reasons[-1]
    assert recommend("deepseek-v3", 1000, 200, rate=4).deployment == "MoE + expert sharding"
    assert recommend("llama-3-8b", 512, 128, rate=4, device_memory_gb=16).deployment.startswith("tensor parallel")
    curve = LatencyCurve((1, 4), (50, 900), (10, 40))
    assert math.isclose(recommend("llama-3-8b", 512, 128, rate=4, ttft_slo_ms=500, curve=curve).predicted_goodput,
                        1 + 3 * (1 - 0.2) / (1.8 - 0.2))  # ratios 0.2 (TPOT 10/50), then 1.8 (TTFT 900/500)


def test_the_numbers_behind_the_advice_and_their_figure():
    from minipd.viz.serving import plot_deployment

    long = recommend("llama-3-8b", 16000, 256, rate=2)
    assert math.isclose(long.weights_gb, 16.06, rel_tol=0.01) and long.device_gb == 80
    assert 40 < long.kv_gb < 80 and long.weights_gb + long.kv_gb < long.device_gb  # too long, not too big
    assert recommend("deepseek-v3", 1000, 200, rate=4).kv_gb == 0  # the weights alone decided
    ax = plot_deployment(long)
    assert ax.get_title() == "recommended: PD split + KV compression" and len(ax.patches) == 2


def test_the_simulator_decides_colocated_or_split_and_predicts_goodput_at_gpu_scale():
    from minipd.serve.guide import simulate_goodput

    # Long prompts and a tight TPOT: prefill chunks sharing decode steps break it; the split serves more per GPU.
    tight = recommend("llama-3-8b", 6000, 256, rate=2, ttft_slo_ms=2000, tpot_slo_ms=17.5, simulate=True)
    assert tight.simulated.split > tight.simulated.colocated and tight.deployment == "PD split + KV compression"
    assert "section 8's simulator figure" in " ".join(tight.reasons)
    # The same prompts with a 50 ms TPOT: the colocated instance wins, and the guide says so.
    relaxed = simulate_goodput("llama-3-8b", 6000, 256, 2000, 50)
    assert relaxed.colocated > relaxed.split and relaxed.tp == 1
    assert simulate_goodput("llama-3-8b", 8000, 400) is None  # longer than the model's context


def test_the_expert_sharding_and_simulated_goodput_figures():
    from minipd.serve.guide import SimulatedGoodput
    from minipd.viz.serving import plot_expert_sharding, plot_simulated_goodput

    ax, fits = plot_expert_sharding("deepseek-v3", 80)
    assert fits == 64 and ax.get_xlabel() == "expert-parallel size (devices)"
    ax = plot_simulated_goodput({"a": SimulatedGoodput(10, 5, 1, "H100 SXM"), "b": SimulatedGoodput(2, 4, 1, "H100")},
                                {"a": "one dense instance", "b": "PD split"})
    assert len(ax.patches) == 4
