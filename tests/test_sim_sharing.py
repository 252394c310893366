"""Instances sharing one machine's cores: the processor-sharing resource, the overlap measurement and the fit."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from minipd.engine.stats import StepStats, StepWork
from minipd.serve.workload import PlannedRequest, synthetic_workload
from minipd.sim.cluster import ClusterSpec, InstanceSpec, simulate
from minipd.sim.instance import InstanceConfig
from minipd.sim.roofline import Link
from minipd.sim.sharing import SharedCores, fit_shared, shared_errors, step_overlaps


def _ends(steps: list[tuple[str, float, float, float]]) -> dict[str, float]:
    """Run steps (name, start, seconds alone, slowdown) on shared cores; when each ended."""
    env = simpy.Environment()
    cores = SharedCores(env)
    ends: dict[str, float] = {}

    def one(name: str, start: float, seconds: float, slowdown: float):
        yield env.timeout(start)
        yield cores.run(name, seconds, slowdown)
        ends[name] = env.now

    for step in steps:
        env.process(one(*step))
    env.run()
    return ends


def test_steps_side_by_side_slow_each_other_by_their_own_slowdown():
    # Alone: its own time.
    assert _ends([("a", 0.0, 1.0, 1.0)]) == {"a": pytest.approx(1.0)}
    # Two of 1 s, σ = 1, together: each at half speed, both end at 2 s.
    assert _ends([("a", 0.0, 1.0, 1.0), ("b", 0.0, 1.0, 1.0)]) == {"a": pytest.approx(2.0), "b": pytest.approx(2.0)}
    # 1 s and 0.5 s together: the short one ends at 1 s (0.5 s of work at half speed), the long one has 0.5 s of
    # work left and runs it alone, ending at 1.5 s.
    assert _ends([("a", 0.0, 1.0, 1.0), ("b", 0.0, 0.5, 1.0)]) == {"a": pytest.approx(1.5), "b": pytest.approx(1.0)}
    # A step joining halfway: a has done 0.5 s alone, then both at half speed: a ends at 0.5 + 1.0.
    ends = _ends([("a", 0.0, 1.0, 1.0), ("b", 0.5, 1.0, 1.0)])
    assert ends == {"a": pytest.approx(1.5), "b": pytest.approx(2.0)}  # (b: 0.5 s done by 1.5, the rest alone)
    # The slowdown is the slowed instance's own: σ = 0 runs at full speed beside anything, σ = 0.25 takes
    # 1.25x while overlapped.
    ends = _ends([("fast", 0.0, 1.0, 0.0), ("slow", 0.0, 2.0, 0.25)])
    assert ends["fast"] == pytest.approx(1.0)
    assert ends["slow"] == pytest.approx(1.0 + (2.0 - 1.0 / 1.25))
    # Three at once with σ = 0.5: speed 1 / (1 + 0.5·2) = 1/2 each.
    assert _ends([(n, 0.0, 1.0, 0.5) for n in "abc"]) == {n: pytest.approx(2.0) for n in "abc"}


def test_an_instance_cannot_start_a_second_step_before_its_first_ends():
    env = simpy.Environment()
    cores = SharedCores(env)
    cores.run("a", 1.0, 0.5)
    with pytest.raises(RuntimeError, match="a started a step"):
        cores.run("a", 1.0, 0.5)


def _disaggregated(slowdown: float) -> ClusterSpec:
    config = InstanceConfig(num_kv_blocks=400, block_size=16)

    class Linear:
        def step_time(self, work: StepWork) -> float:
            return 0.002 + 2e-5 * work.prefill_tokens + 1e-4 * work.decode_rows

    return ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(), config, sharing_slowdown=slowdown),
                                             InstanceSpec("decode", Linear(), config, sharing_slowdown=slowdown),
                                             100.0, Link("test", 1e9, 0.001))


def test_sharing_cores_slows_a_loaded_cluster_and_leaves_a_lone_request_alone():
    # One request: its prefill and its decode never overlap, so sharing changes nothing.
    lone = [PlannedRequest(0.0, 200, 5)]
    plain, shared = simulate(_disaggregated(0.0), lone), simulate(_disaggregated(0.5), lone)
    assert shared.requests[0].token_times == pytest.approx(plain.requests[0].token_times)
    # Under load prefill and decode steps overlap: everything takes longer, by at most 1.5x.
    workload = synthetic_workload(200, 60.0, "64:256", "8:32", seed=3)
    plain, shared = simulate(_disaggregated(0.0), workload), simulate(_disaggregated(0.5), workload)
    fast, slow = plain.summary(), shared.summary()
    assert slow["median_tpot_ms"] > 1.05 * fast["median_tpot_ms"]
    assert slow["median_tpot_ms"] < 1.5 * fast["median_tpot_ms"]
    assert slow["median_ttft_ms"] > fast["median_ttft_ms"]
    assert shared.num_dropped == 0 and all(r.finished is not None for r in shared.requests)
    assert shared.instances["prefill0"].busy_time > plain.instances["prefill0"].busy_time
    with pytest.raises(ValueError, match="sharing_slowdown"):
        InstanceSpec("prefill", None, InstanceConfig(num_kv_blocks=4), sharing_slowdown=-0.1)


def _step(start: float, duration: float, worker: str, tokens: int = 0, rows: int = 1) -> StepStats:
    # An idle engine after each step (num_running = 0): its cycle time is its own duration.
    chunks = (tokens,) if tokens else ()
    return StepStats(start_time=start, duration=duration, num_prefill_tokens=tokens, num_decode_tokens=rows,
                     num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_free=0, prefix_hit_rate=0.0,
                     num_preemptions=0, num_context_tokens=tokens + rows * 100, prefill_chunk_sizes=chunks,
                     prefill_chunk_contexts=chunks, worker=worker)


def test_overlaps_count_the_seconds_any_other_worker_was_mid_step():
    mine = [_step(0.0, 1.0, "p"), _step(2.0, 1.0, "p"), _step(4.0, 1.0, "p")]
    decode = [_step(0.5, 1.0, "d"), _step(2.2, 0.2, "d"), _step(2.3, 0.3, "d")]  # (the last two overlap each other)
    other = [_step(4.9, 0.5, "x")]
    assert step_overlaps(mine, [decode, other]) == pytest.approx([0.5, 0.4, 0.1])
    assert step_overlaps(mine, []) == [0.0, 0.0, 0.0]


def test_the_fit_recovers_the_time_alone_and_the_slowdown():
    rng = np.random.default_rng(0)
    samples, overlaps = [], []
    slowdown = 0.3
    share = slowdown / (1 + slowdown)
    for _ in range(400):
        tokens = int(rng.integers(16, 256))
        work = StepWork(prefill_tokens=tokens, prefill_rows=1, prefill_pairs=tokens * tokens // 2)
        alone = 0.002 + 3e-5 * tokens
        overlap = float(rng.uniform(0, 1)) * alone * (1 + slowdown) * float(rng.integers(0, 2))
        samples.append((work, (alone + share * overlap) * float(rng.normal(1, 0.01))))
        overlaps.append(overlap)
    model, fitted = fit_shared(samples, overlaps)
    assert fitted == pytest.approx(slowdown, rel=0.05)
    probe = StepWork(prefill_tokens=128, prefill_rows=1, prefill_pairs=128 * 64)
    assert model.step_time(probe) == pytest.approx(0.002 + 3e-5 * 128, rel=0.03)
    assert np.abs(shared_errors(model, fitted, samples, overlaps)).mean() < 0.02
    # Steps that never overlapped anything: no slowdown to find.
    _, none = fit_shared(samples, [0.0] * len(samples))
    assert none == 0.0
    with pytest.raises(ValueError, match="one overlap per sample"):
        fit_shared(samples, overlaps[:-1])


def test_the_fit_finds_the_slowdown_when_longer_steps_overlap_more():
    """The usual case: a long step is likelier to have the other worker's steps beside it (an alternating fit of
    the model and the share crawled there: 0.08 after 20 rounds for a true 0.3)."""
    rng = np.random.default_rng(1)
    slowdown = 0.3
    share = slowdown / (1 + slowdown)
    samples, overlaps = [], []
    for _ in range(600):
        tokens = int(rng.integers(16, 256))
        work = StepWork(prefill_tokens=tokens, prefill_rows=1, prefill_pairs=tokens * tokens // 2)
        alone = 0.002 + 3e-5 * tokens
        overlap = float(rng.uniform(0.6, 1.0)) * alone * (1 + slowdown)
        samples.append((work, (alone + share * overlap) * float(rng.normal(1, 0.01))))
        overlaps.append(overlap)
    samples.append((StepWork(), 0.5))  # (no tokens: left out, as the step model leaves it)
    overlaps.append(0.5)
    _, fitted = fit_shared(samples, overlaps)
    assert fitted == pytest.approx(slowdown, rel=0.05)
