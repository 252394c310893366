"""minipd.viz.sim: chapter 05b's figures draw what they are given, and the explorer's figure what it simulated."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from minipd.serve.loadgen import RequestResult, Slo
from minipd.sim.roofline import IB_400G
from minipd.viz.sim import (
    ARTICLE,
    KIND_COLORS,
    plot_attainment,
    plot_best_placement,
    plot_claims,
    plot_goodput_bars,
    plot_goodput_vs_duration,
    plot_real_vs_sim,
    plot_replay,
    plot_simulator,
    plot_step_times,
    plot_transfer_share,
    simulate_placements,
)


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def gids(ax, prefix: str) -> list[str]:
    found = [a.get_gid() for a in [*ax.patches, *ax.lines, *ax.collections, *ax.texts]]
    return [g for g in found if g and g.startswith(prefix)]


def by_gid(ax, gid: str):
    return next(a for a in [*ax.patches, *ax.lines, *ax.collections] if a.get_gid() == gid)


def test_the_diagram_draws_every_part_of_the_simulator():
    ax = plot_simulator()
    parts = {g.removeprefix("sim:") for g in gids(ax, "sim:")}
    assert parts == {"arrivals", "router", "prefill", "link", "decode", "colocated", "results", "models"}
    text = " ".join(t.get_text() for t in ax.texts)
    for word in ("Scheduler", "BlockManager", "step_time(StepWork)", "FittedStepTime", "RooflineStepTime", "simpy"):
        assert word in text


def result(ttft: float, tpot: float) -> RequestResult:
    return RequestResult(0.0, 0.0, True, "", 10, 5, ttft, ttft + 4 * tpot, [tpot] * 4)


def test_the_replay_plot_puts_each_request_at_real_against_simulated():
    real = [result(0.010, 0.002), result(0.030, 0.004)]
    simulated = [result(0.011, 0.002), result(0.029, 0.005)]
    axes = plot_replay(real, simulated, title="tiny-py")
    assert by_gid(axes[0], "requests").get_offsets().ravel().tolist() == pytest.approx([10, 11, 30, 29])
    assert by_gid(axes[1], "requests").get_offsets().ravel().tolist() == pytest.approx([2, 2, 4, 5])
    assert axes[0].get_title(loc="left") == "tiny-py: TTFT, 2 requests"
    with pytest.raises(ValueError, match="same requests"):
        plot_replay(real, simulated[:1])


def rows(rates, factor):
    keys = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")
    return [{"rate": r, **{k: {"real": 10.0 * r, "sim": 10.0 * r * factor, "repeat": 10.0 * r + 1} for k in keys}}
            for r in rates]


def test_real_against_simulated_draws_a_row_per_engine_and_the_goodputs():
    runs = {"colocated": rows([1, 2, 4], 1.1), "1P1D": rows([1, 2], 0.9)}
    axes = plot_real_vs_sim(runs, {"colocated": {"real": 10, "sim": 12, "repeat": 11}, "1P1D": {"real": 8, "sim": 6}},
                            machine="a test machine")
    assert axes.shape == (2, 3)
    line = by_gid(axes[0][0], "sim:median_ttft_ms")
    assert list(line.get_xdata()) == [1, 2, 4] and list(line.get_ydata()) == pytest.approx([11, 22, 44])
    assert list(by_gid(axes[1][1], "real:p90_tpot_ms").get_ydata()) == pytest.approx([10, 20])
    assert by_gid(axes[0][1], "repeat:median_tpot_ms").get_offsets()[:, 1].tolist() == pytest.approx([11, 21, 41])
    heights = [p.get_height() for p in axes[1][2].patches if p.get_gid() == "goodput"]
    assert heights == [8, 6]
    assert [p.get_height() for p in axes[0][2].patches if p.get_gid() == "goodput"] == [10, 12, 11]
    assert "-25%" in axes[1][2].get_title(loc="left")
    assert axes[0][0].figure._suptitle.get_text() == "a test machine"
    # A second simulation kept in the rows is drawn dotted, where an engine has it.
    shared = rows([1, 2], 1.2)
    for row in shared:
        row["shared_cores"] = {k: {"sim": v["sim"] * 2} for k, v in row.items() if k.endswith("_ms")}
    axes = plot_real_vs_sim({"colocated": rows([1, 2], 1.0), "1P1D": shared}, variants={"shared_cores": "cores shared"})
    assert not gids(axes[0][0], "shared_cores:")
    assert list(by_gid(axes[1][0], "shared_cores:median_ttft_ms").get_ydata()) == pytest.approx([24, 48])
    assert gids(axes[1][1], "shared_cores:") == ["shared_cores:median_tpot_ms"]
    two = plot_real_vs_sim({"colocated": rows([1], 1.0)})
    assert two.shape == (1, 2)
    with pytest.raises(ValueError):
        plot_real_vs_sim({})


def test_step_times_draw_the_measured_and_each_model():
    ax = plot_step_times([1, 10, 100], [30.0, 31.0, 40.0], {"roofline": [5.0, 5.5, 9.0]}, title="H200")
    assert by_gid(ax, "measured").get_offsets()[:, 1].tolist() == [30, 31, 40]
    assert by_gid(ax, "model:roofline").get_offsets()[:, 1].tolist() == [5, 5.5, 9]
    with pytest.raises(ValueError, match="roofline"):
        plot_step_times([1, 2], [1.0, 2.0], {"roofline": [1.0]})


def test_attainment_curves_are_coloured_by_kind_and_scaled_per_gpu():
    curves = {"2C": ([2, 4, 8], [1.0, 0.95, 0.5]), "1P+1D": ([2, 4, 8], [1.0, 1.0, 0.7])}
    ax = plot_attainment(curves, per_device={"2C": 2, "1P+1D": 2})
    co, dis = by_gid(ax, "curve:2C"), by_gid(ax, "curve:1P+1D")
    assert list(co.get_xdata()) == [1, 2, 4] and list(co.get_ydata()) == pytest.approx([100, 95, 50])
    assert co.get_color() == KIND_COLORS["colocated"] and dis.get_color() == KIND_COLORS["disaggregated"]
    assert list(by_gid(ax, "target").get_ydata()) == [90, 90]


def test_goodput_bars_are_ranked_and_coloured():
    placements = [{"name": "4C", "kind": "colocated", "per_device": 5.5},
                  {"name": "2P+2D", "kind": "disaggregated", "per_device": 3.6},
                  {"name": "2C(tp2)", "kind": "colocated", "per_device": 8.25}]
    ax = plot_goodput_bars(placements, highlight=["2P+2D"])
    bars = [p for p in ax.patches if (p.get_gid() or "").startswith("placement:")]
    assert [b.get_gid() for b in bars] == ["placement:2P+2D", "placement:4C", "placement:2C(tp2)"]
    assert [b.get_width() for b in bars] == [3.6, 5.5, 8.25]
    assert bars[0].get_hatch() == "//" and not bars[1].get_hatch()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["2P+2D", "4C", "2C(tp2)"]


def test_goodput_against_run_length_draws_a_line_per_placement_in_order_of_length():
    points = [{"placement": "1C(tp2)", "duration_s": 300.0, "per_device": 3.7},
              {"placement": "1C(tp2)", "duration_s": 20.0, "per_device": 5.4},
              {"placement": "1P(tp2)+1D", "duration_s": 20.0, "per_device": 3.5},
              {"placement": "1P(tp2)+1D", "duration_s": 300.0, "per_device": 1.3}]
    ax = plot_goodput_vs_duration(points, marks={"steady": 347.0})
    co, dis = by_gid(ax, "curve:1C(tp2)"), by_gid(ax, "curve:1P(tp2)+1D")
    assert list(co.get_xdata()) == [20.0, 300.0] and list(co.get_ydata()) == [5.4, 3.7]
    assert co.get_color() == KIND_COLORS["colocated"] and dis.get_color() == KIND_COLORS["disaggregated"]
    assert list(by_gid(ax, "mark:steady").get_xdata()) == [347.0, 347.0] and ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["20", "300"]
    with pytest.raises(ValueError, match="no points"):
        plot_goodput_vs_duration([])


def test_the_best_placement_grid_shows_the_winner_and_the_ratio():
    def cell(prompts, outputs, slo, co, dis):
        return {"prompts": prompts, "outputs": outputs, "tpot_slo_ms": slo,
                "placements": [{"name": "4C", "kind": "colocated", "per_device": co},
                               {"name": "3P+1D", "kind": "disaggregated", "per_device": dis},
                               {"name": "1P+3D", "kind": "disaggregated", "per_device": dis / 2}]}
    cells = [cell("128:512", "16:64", 15, 10, 5), cell("2048:4096", "16:64", 15, 4, 6),
             cell("128:512", "16:64", 40, 20, 10), cell("2048:4096", "16:64", 40, 8, 8)]
    axes = plot_best_placement(cells)
    assert len(axes) == 2
    texts = {t.get_gid(): t.get_text() for t in axes[0].texts}
    assert texts == {"cell:0,0": "4C\n0.50×", "cell:1,0": "3P+1D\n1.50×"}
    assert axes[1].get_title(loc="left") == "TPOT SLO 40 ms"
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["128:512", "2048:4096"]


def test_transfer_share_draws_each_link_and_mode():
    ax = plot_transfer_share({"400G, whole": ([1024, 4096], [0.1, 0.2]), "400G, layer-wise": ([1024, 4096],
                                                                                               [0.01, 0.02])})
    whole, layered = by_gid(ax, "share:400G, whole"), by_gid(ax, "share:400G, layer-wise")
    assert list(whole.get_ydata()) == pytest.approx([10, 20]) and whole.get_linestyle() == "-"
    assert layered.get_linestyle() == "--" and layered.get_color() == whole.get_color()


def test_the_claims_figure_draws_both_placements_and_the_articles_numbers():
    def side(ttft, tpot, busy):
        return {"median_ttft_ms": ttft, "mean_tpot_ms": tpot, "busy": {"a": busy, "b": busy / 2}, "placement": "x"}
    points = [{"rate": 1.0, "colocated": side(100, 20, 0.8), "disaggregated": side(110, 15, 0.6)},
              {"rate": 2.0, "colocated": side(120, 22, 1.0), "disaggregated": side(130, 16, 0.8)}]
    axes = plot_claims(points)
    assert list(by_gid(axes[0], "disaggregated:median_ttft_ms").get_ydata()) == [110, 130]
    assert list(by_gid(axes[2], "colocated:busy").get_ydata()) == pytest.approx([60, 75])
    assert by_gid(axes[1], "article:disaggregated:tpot_ms").get_ydata()[0] == ARTICLE["tpot_ms"][1]
    assert by_gid(axes[2], "article:colocated:busy").get_ydata()[0] == pytest.approx(100 * ARTICLE["busy"][0])


def test_the_explorers_figure_compares_the_placements_it_simulated():
    from minipd.viz.sim import draw_placements

    results = simulate_placements(["2C", "1P+1D"], 4.0, 512, 32, IB_400G, duration_s=2.0)
    assert {r.spec.describe() for r in results.values()} == {"2C", "1P+1D"}
    assert all(len(r.requests) == 100 for r in results.values())
    axes, again = draw_placements(4.0, 512, 32, 300, 20, IB_400G, "1P+1D", devices=2, results=results)
    assert again == results  # nothing simulated again
    cdf = by_gid(axes[0], "cdf:ttft:1P+1D")
    assert len(cdf.get_xdata()) == 100 and cdf.get_ydata()[-1] == pytest.approx(100)
    assert list(by_gid(axes[0], "slo:ttft").get_xdata()) == [300, 300]
    met = [p.get_height() for p in axes[2].patches if p.get_gid() == "attainment"]
    assert met == pytest.approx([100 * results[n].attainment(Slo(300, 20)) for n in ("2C", "1P+1D")])
    assert "Llama-3-8B on 2 H100s" in axes[0].figure._suptitle.get_text()


def test_the_explorer_builds_and_redraws():
    pytest.importorskip("ipywidgets")
    from minipd.viz.sim import cluster_explorer

    box = cluster_explorer(devices=2)
    assert "cluster explorer: it needs a live kernel" in repr(box)
    controls = [c for row in box.children[:2] for c in row.children]
    rate = next(c for c in controls if c.description == "requests/s")
    rate.value = rate.value + 1  # redraws (simulates again) without raising
    assert {c.description for c in controls} >= {"TTFT SLO (ms)", "TPOT SLO (ms)", "prompt tokens",
                                                  "output tokens", "K/V link", "placement"}


class TenthOfASecond:
    def step_time(self, work):
        return 0.1


def test_utilisation_while_arriving_counts_the_steps_while_requests_arrive_not_the_drain():
    from minipd.serve.workload import PlannedRequest
    from minipd.sim.cluster import ClusterSpec, simulate
    from minipd.sim.instance import InstanceConfig

    workload = [PlannedRequest(0.0, 10, 2), PlannedRequest(1.0, 10, 2)]  # two steps each, 0.1 s a step
    spec = ClusterSpec.colocated(TenthOfASecond(), InstanceConfig(num_kv_blocks=8))
    result = simulate(spec, workload, keep_timeline=True)
    assert result.utilisation()["colocated0"] == pytest.approx(0.4 / 1.2)
    # [0, 1 s]: the first request's two steps
    assert result.utilisation(while_arriving=True)["colocated0"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="keep_timeline"):
        simulate(spec, workload).utilisation(while_arriving=True)


def test_placements_of_one_kind_share_a_colour_and_differ_by_line_style():
    from minipd.viz.sim import plot_placements

    results = simulate_placements(["2C", "1P+1D"], 4.0, 256, 16, IB_400G, duration_s=1.0)
    results["1P+1D (again)"] = results["1P+1D"]
    axes = plot_placements(results, Slo(300, 20))
    split, again = by_gid(axes[1], "cdf:tpot:1P+1D"), by_gid(axes[1], "cdf:tpot:1P+1D (again)")
    assert split.get_color() == again.get_color() == KIND_COLORS["disaggregated"]
    assert split.get_linestyle() != again.get_linestyle()
