"""Goodput search and placements: the bisection finds the edge, units multiply, every placement spends the budget."""

from __future__ import annotations

import math

import pytest

from minipd.engine.stats import StepWork
from minipd.serve.loadgen import RequestResult, Slo
from minipd.sim.cli import main as simulate_main
from minipd.sim.cli import parse_placement
from minipd.sim.cluster import simulate
from minipd.sim.costs import A100_80GB, H100_SXM, preset
from minipd.sim.roofline import NVLINK4
from minipd.sim.search import (
    GpuCluster,
    WorkloadShape,
    find_goodput,
    placement_goodput,
    placements,
    search_placements,
    search_start,
    steady_duration,
    unit_of,
)


def fake_run(edge: float):
    """Every request meets a 100 ms TTFT below ``edge`` req/s, none above."""
    def run_at(rate: float) -> list[RequestResult]:
        ttft = 0.05 if rate <= edge else 0.5
        return [RequestResult(0.0, 0.0, True, "", 10, 2, ttft, ttft + 0.01, [0.01])] * 10
    return run_at


@pytest.mark.parametrize("edge", [0.3, 3.7, 55.0])
def test_the_goodput_search_brackets_the_edge_within_its_tolerance(edge):
    rate, tried = find_goodput(fake_run(edge), Slo(ttft_ms=100), start=2.0, rel_tol=0.02)
    assert edge * 0.98 <= rate <= edge
    assert len(tried) <= 24


def test_goodput_is_zero_when_nothing_meets_the_slo_and_bad_arguments_are_refused():
    assert find_goodput(fake_run(-1.0), Slo(ttft_ms=100))[0] == 0.0
    with pytest.raises(ValueError, match="start"):
        find_goodput(fake_run(1.0), Slo(ttft_ms=100), start=0)


def test_a_workload_lasts_its_duration_whatever_the_rate():
    shape = WorkloadShape(100, 10, num_requests=50, duration_s=20.0)
    assert len(shape.at(1.0)) == 50 and len(shape.at(10.0)) == 200
    assert shape.at(10.0)[-1].send_at == pytest.approx(20.0, rel=0.2)
    assert [r.prompt_len for r in shape.at(10.0)[:50]] == [r.prompt_len for r in shape.at(2.0)[:50]]


def test_a_steady_run_lasts_twenty_lifetimes_of_a_request_that_just_meets_the_slos():
    # 100 ms to the first token, then 64 tokens (the mean of 32:96) at 25 ms: 1.7 s; 20 of them.
    assert steady_duration("32:96", Slo(100, 25)) == pytest.approx(20 * (0.1 + 64 * 0.025), rel=0.01)
    assert steady_duration(64, Slo(tpot_ms=10), lifetimes=5, floor_s=0) == pytest.approx(3.2)
    assert steady_duration(8, Slo(100, 10)) == 30.0  # the floor
    with pytest.raises(ValueError, match="tpot_ms"):
        steady_duration(64, Slo(ttft_ms=100))
    with pytest.raises(ValueError, match="lifetimes"):
        steady_duration(64, Slo(100, 10), lifetimes=0)


def test_short_runs_overstate_goodput_and_steady_ones_agree_with_longer_ones():
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    slo = Slo(300, 20)
    steady = steady_duration("32:96", slo)

    def goodput(duration_s: float) -> float:
        shape = WorkloadShape("512:2048", "32:96", 50, duration_s=duration_s)
        return placement_goodput(cluster.colocated(1, 1), shape, slo, start=8.0, rel_tol=0.05)[0]

    short, steady_goodput, longer = goodput(2.0), goodput(steady), goodput(2 * steady)
    # Two seconds of arrivals pass rates the instance cannot sustain: no queue has had time to grow.
    assert short > 1.2 * steady_goodput
    assert abs(steady_goodput / longer - 1) <= 0.1


def test_placements_spend_the_budget_and_reduce_to_units():
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    specs = placements(cluster, 4, tps=(1, 2))
    names = [s.describe() for s in specs]
    assert {"4C", "2C(tp2)", "1P+3D", "3P+1D", "2P+2D", "1P(tp2)+2D", "2P+1D(tp2)", "1P(tp2)+1D(tp2)"} <= set(names)
    assert all(s.devices == 4 for s in specs)
    unit, copies = unit_of(parse_placement("4P+2D", cluster))
    assert unit.describe() == "2P+1D" and copies == 2
    assert unit_of(parse_placement("3C(tp2)", cluster))[0].describe() == "1C(tp2)"
    with pytest.raises(ValueError, match="placement"):
        parse_placement("2X", cluster)
    # OPT-66B (132 GB of weights) fits no single A100 80GB: no tp=1 placement is offered.
    big = GpuCluster(preset("opt-66b"), A100_80GB, NVLINK4)
    assert all(i.devices >= 2 for s in placements(big, 4, tps=(1, 2, 4)) for i in s.instances)


def test_units_below_the_budget_are_the_placements_no_full_one_is_copies_of():
    cluster = GpuCluster(preset("opt-13b"), A100_80GB, NVLINK4)
    full = {s.describe() for s in placements(cluster, 4, tps=(1, 2))}
    every = [s.describe() for s in placements(cluster, 4, tps=(1, 2), units_below=True)]
    assert full <= set(every) and len(every) == len(set(every))
    # DistServe's own OPT-13B placement (three GPUs) is in; halves and thirds of full ones are not.
    assert set(every) - full == {"1P(tp2)+1D", "1P+1D(tp2)", "2P+1D", "1P+2D"}
    assert {unit_of(s)[0].describe() for s in placements(cluster, 4, tps=(1, 2), units_below=True)} == \
        {unit_of(s)[0].describe() for s in placements(cluster, 4, tps=(1, 2))} | (set(every) - full)
    assert [s.describe() for s in placements(cluster, 4, tps=(1, 2), disaggregated=False, units_below=True)] == \
        ["4C", "2C(tp2)"]  # 3C and 1C(tp2) are copies of 1C and of half of 2C(tp2)


def test_the_search_ranks_by_goodput_per_device_and_checks_the_best_whole():
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    shape = WorkloadShape("256:1024", "32:128", num_requests=100, duration_s=10.0)
    specs = [cluster.colocated(2, 1), cluster.disaggregated(1, 1, 1, 1)]
    ranked = search_placements(specs, shape, Slo(ttft_ms=300, tpot_ms=40), rel_tol=0.1, verify=1)
    assert [r.per_device for r in ranked] == sorted((r.per_device for r in ranked), reverse=True)
    assert all(r.goodput > 0 for r in ranked)
    # The whole placement at the unit's goodput: near the 90% target, not exactly on it (the router's split
    # is not two independent halves); the figure is what the search reports beside its answer.
    assert ranked[0].verified is not None and 0.5 <= ranked[0].verified <= 1.0
    assert ranked[1].verified is None
    # 2C is searched as one instance and doubled.
    colocated = next(r for r in ranked if r.name == "2C")
    assert max(rate for rate, _ in colocated.tried) * 2 >= colocated.goodput


@pytest.mark.parametrize("placement", ["1C", "1P+1D", "2P+1D"])
def test_a_run_stopped_at_its_verdict_gives_the_whole_runs_verdict_sooner(placement):
    """Rates below, near and above the edge: stopped once certain, a run passes or fails exactly as the same
    run taken to its end, its attainment a lower bound of the whole run's; overloaded, it stops well before."""
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    spec = parse_placement(placement, cluster)
    shape = WorkloadShape("256:2048", "16:128", num_requests=100, duration_s=6.0)
    slo = Slo(ttft_ms=250, tpot_ms=25)
    verdicts, saved = set(), []
    for rate in (2, 8, 14, 24, 40):
        whole = simulate(spec, shape.at(rate * spec.devices))
        for target in (0.5, 0.9):
            early = simulate(spec, shape.at(rate * spec.devices), until_verdict=(slo, target))
            assert (early.attainment(slo) >= target) == (whole.attainment(slo) >= target), (rate, target)
            assert early.attainment(slo) <= whole.attainment(slo) + 1e-12
            verdicts.add(whole.attainment(slo) >= target)
            if early.stopped_early:
                assert sum(r.finished is None and not r.dropped for r in early.requests) > 0
            saved.append(early.duration / whole.duration)
    assert verdicts == {True, False}  # both sides of the edge were tried
    assert min(saved) < 0.5  # an overloaded run is decided long before its queue drains


def test_the_goodput_search_finds_the_same_rate_with_runs_stopped_at_their_verdicts():
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    shape = WorkloadShape("256:1024", "32:128", num_requests=60, duration_s=5.0)
    slo = Slo(ttft_ms=300, tpot_ms=40)
    for spec in (cluster.colocated(1, 1), cluster.disaggregated(1, 1, 1, 1)):
        whole = find_goodput(lambda r, s=spec: simulate(s, shape.at(r)).results(), slo, start=8.0, rel_tol=0.05)
        early = find_goodput(lambda r, s=spec: simulate(s, shape.at(r), until_verdict=(slo, 0.9)).results(), slo,
                             start=8.0, rel_tol=0.05)
        assert early[0] == whole[0] > 0
        assert [rate for rate, _ in early[1]] == [rate for rate, _ in whole[1]]
    with pytest.raises(ValueError, match="attainment"):
        simulate(spec, shape.at(1.0), until_verdict=(slo, 1.5))


def test_the_command_line_runs_a_placement_and_writes_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert simulate_main(["--model", "llama-3-8b", "--gpu", "h100", "--placement", "1P+1D", "--rate", "2",
                          "--num-requests", "40", "--ttft-slo-ms", "500", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1P+1D at 2.0 req/s" in printed and "prefill0: busy" in printed
    import json

    report = json.loads(out.read_text())
    assert report["placement"] == "1P+1D" and report["summary"]["completed"] == 40


def test_the_command_lines_goodput_runs_last_a_steady_duration_unless_told(tmp_path, capsys):
    common = ["--model", "llama-3-8b", "--gpu", "h100", "--placement", "1C", "--goodput", "--rate", "8",
              "--output-lens", "32:96", "--ttft-slo-ms", "300", "--tpot-slo-ms", "20"]
    out = tmp_path / "goodput.json"
    assert simulate_main([*common, "--json", str(out)]) == 0
    steady = steady_duration("32:96", Slo(300, 20))
    assert f"each run: {steady:.0f} s of arrivals" in capsys.readouterr().err
    import json

    assert json.loads(out.read_text())["duration_s"] == pytest.approx(steady)
    # Without a TPOT target a request's lifetime is unknown: 30 s.
    no_tpot = [arg for arg in common if arg not in ("--tpot-slo-ms", "20")]
    assert simulate_main(no_tpot) == 0
    assert "each run: 30 s of arrivals" in capsys.readouterr().err
    assert simulate_main([*common, "--duration", "5"]) == 0
    assert "each run: 5 s of arrivals" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--duration must be"):
        simulate_main([*common, "--duration", "0"])


def test_the_command_line_takes_efficiencies_refuses_bad_ones_and_uses_the_a100s_own_nvlink(tmp_path, capsys):
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    common = ["--model", "opt-13b", "--gpu", "a100", "--placement", "1P+1D", "--rate", "2", "--num-requests", "30"]
    assert simulate_main([*common, "--json", str(fast)]) == 0
    assert simulate_main([*common, "--compute-efficiency", "0.2", "--memory-efficiency", "0.3",
                          "--step-overhead-ms", "5", "--json", str(slow)]) == 0
    import json

    fast_report, slow_report = json.loads(fast.read_text()), json.loads(slow.read_text())
    assert fast_report["link"] == "NVLink 3" and slow_report["compute_efficiency"] == 0.2
    assert slow_report["summary"]["median_tpot_ms"] > 2 * fast_report["summary"]["median_tpot_ms"]
    with pytest.raises(ValueError, match="efficiencies must be in"):
        simulate_main([*common, "--memory-efficiency", "1.5"])


def test_the_command_line_adds_control_latency_to_every_placement(tmp_path):
    plain, late = tmp_path / "plain.json", tmp_path / "late.json"
    common = ["--model", "llama-3-8b", "--gpu", "h100", "--placement", "1P+1D", "--rate", "0.5", "--num-requests", "20"]
    assert simulate_main([*common, "--json", str(plain)]) == 0
    latency = ["--dispatch-latency-ms", "30", "--output-latency-ms", "20"]
    assert simulate_main([*common, *latency, "--json", str(late)]) == 0
    import json

    fast, slow = json.loads(plain.read_text()), json.loads(late.read_text())
    assert slow["dispatch_latency_s"] == pytest.approx(0.03) and slow["output_latency_s"] == pytest.approx(0.02)
    # At a light load each first token comes both hops (50 ms) later.
    assert slow["summary"]["median_ttft_ms"] - fast["summary"]["median_ttft_ms"] == pytest.approx(50, abs=5)
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4, dispatch_latency_s=0.002, output_latency_s=0.001)
    assert all(spec.dispatch_latency_s == 0.002 and spec.output_latency_s == 0.001 for spec in placements(cluster, 2))
    with pytest.raises(ValueError, match="--output-latency-ms must be"):
        simulate_main([*common, "--output-latency-ms", "-1"])


def test_the_command_line_calibrates_to_a_paper_before_it_runs(tmp_path, capsys):
    out = tmp_path / "calibrated.json"
    assert simulate_main(["--model", "llama-3-8b", "--gpu", "h100", "--calibrate", "distserve-figure1",
                          "--placement", "1C", "--rate", "2", "--num-requests", "20", "--json", str(out)]) == 0
    assert "published 1.6 req/s" in capsys.readouterr().out
    import json

    report = json.loads(out.read_text())
    fitted = report["calibration"]
    assert report["compute_efficiency"] == fitted["compute_efficiency"] < 0.6
    assert [row["figure"] for row in fitted["rows"]][:2] == ["prefill only (fitted)", "decode only (fitted)"]
    assert fitted["rows"][0]["simulated"] == pytest.approx(5.6, rel=0.05)


def _search_case():
    """Four units, both kinds, short runs: a search that takes seconds."""
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    shape = WorkloadShape("256:1024", "32:128", num_requests=60, duration_s=6.0)
    specs = [cluster.colocated(2, 1), cluster.colocated(1, 2), cluster.disaggregated(1, 1, 1, 1),
             cluster.disaggregated(1, 1, 2, 1)]
    return specs, shape, Slo(ttft_ms=300, tpot_ms=40)


def _by_name(ranked):
    return {r.name: (r.goodput, r.tried, r.upper) for r in ranked}


def test_the_search_finds_the_same_goodputs_in_any_order_and_on_any_number_of_processes():
    specs, shape, slo = _search_case()
    serial = _by_name(search_placements(specs, shape, slo, rel_tol=0.1))
    assert _by_name(search_placements(specs[::-1], shape, slo, rel_tol=0.1)) == serial
    assert _by_name(search_placements(specs, shape, slo, rel_tol=0.1, workers=2)) == serial
    # Each unit's search starts at a power of two near its prefill capacity; from another, it finds the same.
    for spec in specs:
        unit = unit_of(spec)[0]
        start = search_start(unit, shape)
        assert serial[spec.describe()][1][0][0] == start == 2.0 ** round(math.log2(start))
    unit = specs[2]
    found = serial[unit.describe()][0]
    for start in (1.0, 64.0, 1024.0):
        assert placement_goodput(unit, shape, slo, start=start, rel_tol=0.1)[0] == found
    with pytest.raises(ValueError, match="workers"):
        search_placements(specs, shape, slo, workers=0)


def test_branch_and_bound_finds_the_best_of_each_kind_exactly_and_brackets_the_rest():
    specs, shape, slo = _search_case()
    every = {r.name: r for r in search_placements(specs, shape, slo, rel_tol=0.1)}
    pruned = search_placements(specs, shape, slo, rel_tol=0.1, exhaustive=False)
    assert _by_name(search_placements(specs, shape, slo, rel_tol=0.1, exhaustive=False, workers=2)) == \
        _by_name(pruned)
    for kind in (False, True):
        best = max((r for r in every.values() if r.spec.disaggregated == kind), key=lambda r: r.per_device)
        found = next(r for r in pruned if r.name == best.name)
        assert found.upper is None and found.goodput == best.goodput and found.tried == best.tried
        for r in pruned:
            if r.spec.disaggregated == kind and r.upper is not None:
                # Left where it failed at a rate per device another of its kind passed; the true goodput is inside.
                assert r.upper_per_device <= best.per_device
                assert r.goodput <= every[r.name].goodput < r.upper
                assert len(r.tried) < len(every[r.name].tried)
    assert any(r.upper is not None for r in pruned)  # the case prunes something
    assert sum(len(r.tried) for r in pruned) < sum(len(r.tried) for r in every.values())


def test_a_placement_that_is_its_own_unit_is_verified_by_its_search_run():
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    shape = WorkloadShape("256:1024", "32:128", num_requests=60, duration_s=6.0)
    slo = Slo(ttft_ms=300, tpot_ms=40)
    spec = cluster.colocated(1, 2)
    (result,) = search_placements([spec], shape, slo, rel_tol=0.1, verify=1)
    whole = simulate(spec, shape.at(result.goodput))
    assert not whole.stopped_early and result.verified == whole.attainment(slo) >= 0.9
    # Runs that passed went to their end: their attainment is the whole run's.
    for rate, share in result.tried:
        if share >= 0.9:
            assert share == simulate(spec, shape.at(rate)).attainment(slo)


class _LocalModel:  # its step time is a lambda: it cannot be pickled
    def __init__(self) -> None:
        self.step_time = lambda work: 0.01 + 1e-5 * work.num_tokens


def test_placements_that_cannot_go_to_another_process_are_refused_with_workers():
    from minipd.sim.cluster import ClusterSpec
    from minipd.sim.instance import InstanceConfig

    config = InstanceConfig(num_kv_blocks=512)
    specs = [ClusterSpec.colocated(_LocalModel(), config, 1, 1), ClusterSpec.colocated(_LocalModel(), config, 1, 2)]
    shape = WorkloadShape(64, 8, num_requests=20, duration_s=2.0)
    with pytest.raises(ValueError, match=r"workers=2.*pickled.*workers=1"):
        search_placements(specs, shape, Slo(ttft_ms=200), workers=2)
    assert all(r.goodput > 0 for r in search_placements(specs, shape, Slo(ttft_ms=200)))


def test_a_run_learns_a_request_misses_at_its_deadline_not_when_it_is_served():
    """A request past its TTFT deadline with no token, or past its last token's TPOT deadline unfinished, is a
    miss already: an overloaded run stops before it has served (or finished) the 21 misses of 200 that decide."""
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    spec = cluster.colocated(1, 1)
    workload = WorkloadShape(512, 64, num_requests=200, duration_s=1.0).at(200.0)
    stuck = simulate(spec, workload, until_verdict=(Slo(ttft_ms=0.001), 0.9))
    assert stuck.stopped_early and sum(bool(r.token_times) for r in stuck.requests) < 21
    slow = simulate(spec, workload, until_verdict=(Slo(tpot_ms=0.001), 0.9))
    assert slow.stopped_early and not any(r.finished for r in slow.requests)
    whole = simulate(spec, workload)
    assert whole.attainment(Slo(ttft_ms=0.001)) == whole.attainment(Slo(tpot_ms=0.001)) == 0.0


def test_the_command_lines_search_brackets_the_losers_unless_exhaustive(tmp_path, capsys):
    import json

    common = ["--model", "llama-3-8b", "--gpu", "h100", "--search", "2", "--output-lens", "32:128",
              "--ttft-slo-ms", "300", "--tpot-slo-ms", "40", "--duration", "6", "--workers", "1"]
    pruned, every = tmp_path / "pruned.json", tmp_path / "every.json"
    assert simulate_main([*common, "--json", str(pruned)]) == 0
    printed = capsys.readouterr()
    assert "(on up to 1 process)" in printed.err and "below the best of its kind" in printed.out
    assert simulate_main([*common, "--exhaustive", "--json", str(every)]) == 0
    assert "below the best of its kind" not in capsys.readouterr().out
    bracketed = {p["placement"]: p for p in json.loads(pruned.read_text())["placements"]}
    exact = {p["placement"]: p for p in json.loads(every.read_text())["placements"]}
    assert bracketed.keys() == exact.keys()
    for name, p in bracketed.items():
        assert exact[name]["upper"] is None
        if p["upper"] is None:
            assert p["goodput"] == exact[name]["goodput"]
        else:
            assert p["goodput"] <= exact[name]["goodput"] < p["upper"]
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        simulate_main([*common[:-1], "0"])


def test_placements_with_a_class_from_a_notebook_are_refused_with_workers(monkeypatch):
    import sys
    import types

    from minipd.sim.cluster import ClusterSpec
    from minipd.sim.instance import InstanceConfig

    notebook = types.ModuleType("__main__")  # as in a kernel: no file a spawned process could import
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    model = type("CellModel", (), {"__module__": "__main__", "step_time": lambda self, work: 0.01})
    notebook.CellModel = model
    specs = [ClusterSpec.colocated(model(), InstanceConfig(num_kv_blocks=512), 1, tp) for tp in (1, 2)]
    with pytest.raises(ValueError, match="defined in this notebook"):
        search_placements(specs, WorkloadShape(64, 8, num_requests=20, duration_s=2.0), Slo(ttft_ms=200), workers=2)


def test_a_search_starts_at_a_power_of_two_near_the_prefill_capacity_or_per_device_when_the_model_cannot_say():
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4)
    shape = WorkloadShape(1024, 64)
    unit = cluster.colocated(1, 1)
    prefill_s = unit.instances[0].model.step_time(StepWork.of(((1024, 1024),), 0, 0))
    start = search_start(unit, shape)
    assert start <= 1 / prefill_s < 2 * start and math.log2(start).is_integer()
    # Two prefill instances of a split: twice the capacity.
    assert search_start(cluster.disaggregated(2, 1, 1, 1), shape) == 2 * start

    class Instant:  # (0 s a step: no capacity to speak of)
        def step_time(self, work):
            return 0.0

    from minipd.sim.cluster import ClusterSpec
    from minipd.sim.instance import InstanceConfig

    assert search_start(ClusterSpec.colocated(Instant(), InstanceConfig(num_kv_blocks=64), 1, 2), shape) == 2.0


def test_deadlines_hold_with_control_latency_and_every_objective():
    """With messages that take time (the client hears of each token 20 ms after its step) and TTFT, TPOT and E2E
    targets, a run stopped at its verdict fails exactly when the whole run does, its attainment a lower bound."""
    cluster = GpuCluster(preset("llama-3-8b"), H100_SXM, NVLINK4, dispatch_latency_s=0.01, output_latency_s=0.02)
    shape = WorkloadShape("256:2048", "16:128", num_requests=100, duration_s=6.0)
    slo = Slo(ttft_ms=300, tpot_ms=25, e2el_ms=2000)
    verdicts = set()
    for spec in (cluster.colocated(1, 1), cluster.disaggregated(1, 1, 1, 1)):
        for rate in (4.0, 10.0, 16.0, 30.0):
            whole = simulate(spec, shape.at(rate))
            early = simulate(spec, shape.at(rate), until_verdict=(slo, 0.9))
            assert (early.attainment(slo) >= 0.9) == (whole.attainment(slo) >= 0.9), (spec.describe(), rate)
            assert early.attainment(slo) <= whole.attainment(slo) + 1e-12
            if not early.stopped_early:
                assert early.attainment(slo) == whole.attainment(slo)
            verdicts.add(whole.attainment(slo) >= 0.9)
    assert verdicts == {True, False}
