"""A run's machine stalls found in its steps and replayed in a simulation (minipd.sim.stalls)."""

from __future__ import annotations

import pytest

from minipd.engine.stats import StepStats, StepWork
from minipd.serve.workload import PlannedRequest
from minipd.sim.cluster import ClusterSpec, simulate
from minipd.sim.fitted import FittedStepTime
from minipd.sim.instance import InstanceConfig
from minipd.sim.stalls import (
    Stall,
    StallingStepTime,
    find_stalls,
    fit_between_stalls,
    replay_run_stalls,
    replay_run_waits,
    without_stalls,
)

#: 1 ms a step plus 10 µs a prompt token, nothing else.
MODEL = FittedStepTime((), ((1e-3, 1e-5, 0.0, 0.0, 0.0),))


def _step(start: float, duration: float, tokens: int = 100, busy: bool = True) -> StepStats:
    return StepStats(start_time=start, duration=duration, num_prefill_tokens=tokens, num_decode_tokens=0,
                     num_running=int(busy), num_waiting=0, kv_blocks_used=0, kv_blocks_free=0, prefix_hit_rate=0.0,
                     num_preemptions=0, num_context_tokens=tokens, prefill_chunk_sizes=(tokens,),
                     prefill_chunk_contexts=(tokens,))


def test_stalls_are_the_steps_far_longer_than_their_work_explains():
    origin, starts = 50.0, [50.0, 50.002, 50.004, 50.036, 50.038]
    # Each step takes 2 ms by the model; the third ran from 50.004 to 50.036: a stall of 30 ms at its start.
    steps = [_step(s, 0.002) for s in starts[:-1]] + [_step(starts[-1], 0.002, busy=False)]
    steps[2] = _step(starts[2], 0.032)
    stalls = find_stalls(MODEL, steps, origin)
    assert len(stalls) == 1
    assert stalls[0].start == pytest.approx(0.004) and stalls[0].duration == pytest.approx(0.030)
    # A step 4 ms longer than predicted is the machine's noise, not a stall, at the default 5 ms threshold.
    starts = [50.0, 50.002, 50.004, 50.010, 50.012]
    steps = [_step(s, 0.002) for s in starts[:-1]] + [_step(starts[-1], 0.002, busy=False)]
    steps[2] = _step(starts[2], 0.006)
    assert find_stalls(MODEL, steps, origin) == [] and len(find_stalls(MODEL, steps, origin, threshold_s=0.003)) == 1
    samples = [(StepWork(prefill_tokens=100, prefill_rows=1), t) for t in (0.002, 0.0021, 0.040, 0.0019)]
    assert [t for _, t in without_stalls(MODEL, samples)] == [0.002, 0.0021, 0.0019]
    with pytest.raises(ValueError, match="threshold_s"):
        find_stalls(MODEL, steps, origin, threshold_s=0)
    with pytest.raises(ValueError, match="duration"):
        Stall(1.0, 0.0)


def test_a_replayed_stall_lengthens_the_steps_it_falls_in_and_no_other():
    now = 0.0
    model = StallingStepTime(MODEL, [Stall(0.100, 0.020), Stall(0.010, 0.020), Stall(0.200, 0.010)])
    work = StepWork(prefill_tokens=400, prefill_rows=1)  # 5 ms
    with pytest.raises(RuntimeError, match="clock"):
        model.step_time(work)
    model.bind(lambda: now)
    assert model.step_time(work) == pytest.approx(0.005)  # ends before the first stall
    now = 0.008  # spans the stall at 10 ms: all 20 ms of it added
    assert model.step_time(work) == pytest.approx(0.025)
    now = 0.110  # starts 10 ms into the stall at 100 ms: waits out the other 10 ms
    assert model.step_time(work) == pytest.approx(0.015)
    now = 0.250  # the stall at 200 ms passed while the instance slept
    assert model.step_time(work) == pytest.approx(0.005)
    assert model.stalled_time == pytest.approx(0.030)
    model.bind(lambda: 0.008)  # a new simulation: the stalls start over
    assert model.step_time(work) == pytest.approx(0.025) and model.stalled_time == pytest.approx(0.020)


def test_a_stall_in_a_simulation_delays_the_requests_behind_it_by_its_length():
    config = InstanceConfig(num_kv_blocks=256)
    workload = [PlannedRequest(0.010 * i, 100, 4) for i in range(20)]
    plain = simulate(ClusterSpec.colocated(MODEL, config), workload)
    stalled = StallingStepTime(MODEL, [Stall(0.0505, 0.040)])
    slowed = simulate(ClusterSpec.colocated(stalled, config), workload)
    assert stalled.stalled_time == pytest.approx(0.040)
    before = [r.ttft for r in plain.results()]
    after = [r.ttft for r in slowed.results()]
    # Requests done before the stall are untouched; the one whose prefill spans it waits all 40 ms of it; the
    # queue behind it drains (requests arriving 100 ms later are back on time).
    assert after[:5] == pytest.approx(before[:5])
    assert after[5] - before[5] == pytest.approx(0.040, abs=0.002)
    assert after[-1] == pytest.approx(before[-1])
    assert all(a >= b - 1e-12 for a, b in zip(after, before, strict=True))


def test_a_run_is_replayed_at_its_speed_between_stalls_with_its_own_stalls():
    # Calibration: steps costing 2 ms + 20 µs a prompt token, three of them stalled by 40 ms (they would pull a
    # least-squares fit up); the run: 10% slower between its two stalls, of 30 and 60 ms.
    def seconds(tokens: int) -> float:
        return 0.002 + 2e-5 * tokens

    calibration = [(StepWork(prefill_tokens=n, prefill_rows=1), seconds(n) + (0.040 if i % 40 == 7 else 0.0))
                   for i, n in enumerate(list(range(16, 256, 2)))]
    model = FittedStepTime.fit(calibration)
    assert model.step_time(StepWork(prefill_tokens=100, prefill_rows=1)) > 1.1 * seconds(100)
    origin, start, steps = 10.0, 10.0, []
    for i, n in enumerate(range(16, 256, 8)):
        took = 1.1 * seconds(n) + {5: 0.030, 20: 0.060}.get(i, 0.0)
        steps.append(_step(start, took, tokens=n, busy=i < 29))
        start += took
    between = fit_between_stalls(model, calibration)
    assert between.step_time(StepWork(prefill_tokens=100, prefill_rows=1)) == pytest.approx(seconds(100))
    replayed, found = replay_run_stalls(between, steps, origin)
    assert found.factor == pytest.approx(1.1, rel=1e-6) and found.stalls == 2
    assert found.stalled_s == pytest.approx(0.090, rel=1e-6)
    assert [s.start for s in replayed.stalls] == pytest.approx([steps[5].start_time - origin,
                                                                steps[20].start_time - origin])
    # Between stalls the replayed model gives the run's own step times.
    assert replayed.model.step_time(steps[3].work) == pytest.approx(1.1 * seconds(steps[3].num_prefill_tokens))


def test_a_run_is_replayed_from_the_waits_for_a_core_its_engine_measured():
    # Steps of 2 ms + 20 µs a prompt token on a core, this run 5% slower there; every third step also waited
    # 1-3 ms for a core (other processes had it), which the engine measured.
    import dataclasses

    def on_core(tokens: int) -> float:
        return 0.002 + 2e-5 * tokens

    model = FittedStepTime((), ((0.002, 2e-5, 0.0, 0.0, 0.0),))
    origin, start, steps = 5.0, 5.0, []
    for i, n in enumerate(range(16, 256, 8)):
        wait = 0.001 * (1 + i % 3) if i % 3 == 0 else 0.0
        took = 1.05 * on_core(n) + wait
        steps.append(dataclasses.replace(_step(start, took, tokens=n, busy=i < 29), cpu_wait=wait))
        start += took
    replayed, found = replay_run_waits(model, steps, origin)
    assert found.factor == pytest.approx(1.05, rel=1e-6)
    waited = [s for s in steps if s.cpu_wait]
    assert found.stalls == len(waited) == 10 and found.stalled_s == pytest.approx(0.010)
    # Each wait sits in the middle of its step, with the run's own time on a core around it.
    assert [x.start for x in replayed.stalls] == pytest.approx(
        [s.start_time - origin + (s.duration - s.cpu_wait) / 2 for s in waited])
    assert replayed.model.step_time(steps[4].work) == pytest.approx(1.05 * on_core(steps[4].num_prefill_tokens))
    with pytest.raises(ValueError, match="no measured wait"):
        replay_run_waits(model, [dataclasses.replace(steps[0], cpu_wait=None)], origin)


def test_stalls_are_drawn_at_the_calibration_rate_with_its_lengths():
    from minipd.sim.stalls import draw_stalls

    # Calibration: 4 stalls of 10 or 30 ms in 2 s (2 a second).
    found = [Stall(0.1, 0.010), Stall(0.7, 0.030), Stall(1.1, 0.010), Stall(1.9, 0.030)]
    drawn = draw_stalls(found, span_s=2.0, horizon_s=5000.0, seed=3)
    assert len(drawn) == pytest.approx(2.0 * 5000, rel=0.05)
    assert {s.duration for s in drawn} == {0.010, 0.030}
    assert sum(s.duration == 0.030 for s in drawn) / len(drawn) == pytest.approx(0.5, abs=0.03)
    starts = [s.start for s in drawn]
    assert starts == sorted(starts) and 0 < starts[0] and starts[-1] <= 5000.0
    assert draw_stalls(found, 2.0, 5000.0, seed=3) == drawn and draw_stalls(found, 2.0, 5000.0, seed=4) != drawn
    assert draw_stalls([], 2.0, 10.0) == []
    with pytest.raises(ValueError, match="span_s must be > 0"):
        draw_stalls(found, 0.0, 10.0)
