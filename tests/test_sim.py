"""minipd.sim's cluster simulator: queueing theory where it has closed forms, conservation, determinism, the
engine's own scheduling decisions (preemption, waiting for K/V), and the KV link's arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minipd.engine.stats import StepWork
from minipd.serve.loadgen import Slo
from minipd.serve.workload import PlannedRequest, synthetic_workload
from minipd.sim.cluster import ClusterSpec, InstanceSpec, simulate
from minipd.sim.instance import InstanceConfig
from minipd.sim.roofline import Link


class Exponential:
    """Service times drawn at random, whatever the step holds (an M/M/1 server when one request runs at a time)."""

    def __init__(self, mean: float, seed: int) -> None:
        self.rng, self.mean = np.random.default_rng(seed), mean

    def step_time(self, work: StepWork) -> float:
        return float(self.rng.exponential(self.mean))


class Linear:
    """A fixed cost per step, per prompt token and per decode row."""

    def __init__(self, fixed: float = 0.01, per_token: float = 1e-4, per_row: float = 2e-4) -> None:
        self.fixed, self.per_token, self.per_row = fixed, per_token, per_row

    def step_time(self, work: StepWork) -> float:
        return self.fixed + self.per_token * work.prefill_tokens + self.per_row * work.decode_rows


ONE_AT_A_TIME = InstanceConfig(num_kv_blocks=4, max_num_seqs=1)


def test_one_request_at_a_time_is_an_m_m_1_queue():
    """Poisson arrivals at 0.7, exponential service of mean 1: the mean wait is ρ / (μ − λ) = 7/3 (within 3%)."""
    workload = synthetic_workload(100_000, 0.7, 1, 1, seed=3)
    result = simulate(ClusterSpec.colocated(Exponential(1.0, seed=5), ONE_AT_A_TIME), workload)
    wait = np.mean([r.queueing for r in result.requests])
    assert wait == pytest.approx(0.7 / 0.3, rel=0.03)
    assert result.utilisation()["colocated0"] == pytest.approx(0.7, abs=0.01)


def test_constant_service_is_an_m_d_1_queue():
    """Deterministic service: the Pollaczek–Khinchine mean wait ρ / (2μ(1 − ρ)), half the M/M/1 one."""
    workload = synthetic_workload(50_000, 0.7, 1, 1, seed=4)
    result = simulate(ClusterSpec.colocated(Linear(1.0, 0.0, 0.0), ONE_AT_A_TIME), workload)
    wait = np.mean([r.queueing for r in result.requests])
    assert wait == pytest.approx(0.7 / (2 * 0.3), rel=0.03)


def test_a_run_is_the_same_for_the_same_seed_and_differs_for_another():
    config = InstanceConfig(num_kv_blocks=400, max_num_batched_tokens=256, max_num_seqs=16)
    spec = ClusterSpec.colocated(Linear(), config, count=2)

    def ttfts(seed: int) -> list[float]:
        result = simulate(spec, synthetic_workload(200, 30, "16:300", "2:40", seed=seed))
        return [r.ttft for r in result.requests]

    assert ttfts(1) == ttfts(1)
    assert ttfts(1) != ttfts(2)


def test_every_request_finishes_or_is_counted_dropped_and_every_block_comes_back():
    """Overload with a small pool: requests are preempted (the engine's scheduler does it) and too-long ones
    dropped; none is lost, every token is produced, every block is free at the end."""
    config = InstanceConfig(num_kv_blocks=40, block_size=16, max_num_batched_tokens=128, max_num_seqs=32)
    workload = synthetic_workload(300, 200, "16:200", "4:100", seed=7)
    workload.append(PlannedRequest(workload[-1].send_at, 2000, 10))  # could never fit 40 blocks of 16
    disaggregated = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(), config),
                                                      InstanceSpec("decode", Linear(), config, 2), 1000.0,
                                                      Link("test", 1e9, 1e-5))
    for spec in (ClusterSpec.colocated(Linear(), config, 2), disaggregated,
                 dataclasses.replace(disaggregated, push=True).with_control_latency(1e-3, 1e-3)):
        result = simulate(spec, workload)
        dropped = [r for r in result.requests if r.dropped]
        assert [r.prompt_len for r in dropped] == [2000]
        assert "2000" in dropped[0].dropped or "blocks" in dropped[0].dropped
        for request in result.requests:
            if not request.dropped:
                assert len(request.token_times) == request.output_len
                assert request.finished is not None and request.finished >= request.token_times[-1]
        assert sum(s.preemptions for s in result.instances.values()) > 0  # the pool really ran out
        summary = result.summary()
        assert summary["completed"] + summary["failed"] == len(workload)


def test_the_routers_count_of_free_blocks_is_never_stale(monkeypatch):
    """SimInstance.free_blocks is summed once per change of its queue or pool: under an overload with
    preemptions, pulled and pushed K/V, every value the router reads equals a fresh count."""
    from minipd.sim.instance import SimInstance

    cached = SimInstance.free_blocks.fget
    reads: list[int] = []

    def checked(instance: SimInstance) -> int:
        value = cached(instance)
        blocks = instance.core.block_manager
        promised = sum(-(-r.num_tokens // blocks.block_size) for r in instance.core.scheduler.waiting
                       if not r.blocks.block_table)
        assert value == blocks.num_free_blocks - promised
        reads.append(value)
        return value

    monkeypatch.setattr(SimInstance, "free_blocks", property(checked))
    config = InstanceConfig(num_kv_blocks=60, block_size=16, max_num_batched_tokens=128, max_num_seqs=32)
    disaggregated = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(), config, 2),
                                                      InstanceSpec("decode", Linear(), config, 2), 1000.0,
                                                      Link("test", 1e9, 1e-5))
    workload = synthetic_workload(300, 200, "16:200", "4:100", seed=5)
    for spec in (disaggregated, dataclasses.replace(disaggregated, push=True).with_control_latency(1e-3, 1e-3)):
        before = len(reads)
        result = simulate(spec, workload)
        assert sum(s.preemptions for s in result.instances.values()) > 0  # the pools really ran out
        assert len(reads) - before > 300  # read for every request placed, and more while prompts were held


def test_a_disaggregated_request_pays_its_transfer_once_between_its_first_and_second_token():
    """One request alone: TTFT is its prefill step; the second token comes after the transfer (latency +
    bytes / bandwidth) and one decode step; layer-wise sending hides what fits in the prefill step."""
    model = Linear(fixed=0.010, per_token=1e-4, per_row=0.0)
    config = InstanceConfig(num_kv_blocks=100)
    link = Link("test", 1e9, 2e-3)
    prompt, per_token = 500, 40_000.0  # 20 MB: 20 ms on the link
    workload = [PlannedRequest(0.0, prompt, 3)]
    for layerwise, visible in ((False, 0.002 + 0.020), (True, 0.022 - 0.060)):
        spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", model, config),
                                                 InstanceSpec("decode", model, config), per_token, link,
                                                 layerwise=layerwise, num_layers=10)
        request = simulate(spec, workload).requests[0]
        prefill = 0.010 + 1e-4 * prompt
        assert request.ttft == pytest.approx(prefill)
        expected = max(visible, 0.022 / 10)  # at least one layer's share is never hidden
        assert request.transfer_time == pytest.approx(expected)
        assert request.token_times[1] - request.token_times[0] == pytest.approx(expected + 0.010)
        assert request.prefill_instance == "prefill0" and request.decode_instance == "decode0"


def test_a_full_decode_pool_holds_new_prompts_back_before_their_prefill():
    """Backpressure, as the real cluster's router does it (the simulator asks the same Router): while no decode
    instance would have room for a prompt once the prefills under way have landed, the prompt waits before its
    prefill (its TTFT grows) instead of its K/V waiting on the prefill instance for a decode slot."""
    small = InstanceConfig(num_kv_blocks=24, block_size=16, max_num_seqs=64)
    spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(0.002, 1e-6, 0), small),
                                             InstanceSpec("decode", Linear(0.02, 0, 1e-4), small), 100.0,
                                             Link("test", 1e12, 0.0))
    workload = synthetic_workload(60, 500, 100, 50, seed=2)
    result = simulate(spec, workload)
    assert all(r.finished is not None and len(r.token_times) == 50 for r in result.requests)
    waits_for_decode = [r.transfer_start - r.token_times[0] for r in result.requests]
    assert max(waits_for_decode) < 0.05  # a prefilled request finds its decode slot at once
    assert max(r.ttft for r in result.requests) > 0.5  # held back before its prefill until a slot freed
    assert result.instances["prefill0"].busy_time < result.instances["decode0"].busy_time


def test_a_prompt_held_back_behind_one_the_decode_pool_refuses_still_runs():
    """A request dropped at the decode instance (too big for its pool) frees the room it was counted for: the
    prompt held back behind it is admitted then, though no decode step comes to look (it hung before)."""
    spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(0.002, 1e-6, 0),
                                                          InstanceConfig(num_kv_blocks=100, block_size=16)),
                                             InstanceSpec("decode", Linear(0.01, 0, 1e-4),
                                                          InstanceConfig(num_kv_blocks=8, block_size=16)), 100.0, None)
    result = simulate(spec, [PlannedRequest(0.0, 200, 4), PlannedRequest(0.001, 50, 4)])
    big, small = result.requests
    assert big.dropped and "decode0" in big.dropped
    assert not small.dropped and len(small.token_times) == 4


def test_the_simulator_routes_with_the_real_clusters_router_or_one_given():
    """Decode goes where the most blocks are free (the real Router); a Router subclass changes it."""
    from minipd.pd.routing import Router

    config = InstanceConfig(num_kv_blocks=200, block_size=16)
    spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(0.002, 1e-6, 0), config),
                                             InstanceSpec("decode", Linear(0.01, 0, 1e-4), config, count=2), 100.0,
                                             None)
    workload = [PlannedRequest(0.001 * i, 64, 40) for i in range(6)]
    spread = simulate(spec, workload)
    assert [r.decode_instance for r in spread.requests] == ["decode0", "decode1"] * 3

    class FirstDecode(Router):
        def decode_worker(self, workers):
            return workers[0]

    first = simulate(spec.with_router(FirstDecode()), workload)
    assert {r.decode_instance for r in first.requests} == {"decode0"}
    assert all(len(r.token_times) == 40 for r in first.requests)


def test_colocated_instances_share_the_load_and_goodput_checks_slos():
    config = InstanceConfig(num_kv_blocks=1000, max_num_batched_tokens=512, max_num_seqs=64)
    workload = synthetic_workload(400, 40, "32:256", "8:64", seed=1)
    one = simulate(ClusterSpec.colocated(Linear(), config, 1), workload)
    two = simulate(ClusterSpec.colocated(Linear(), config, 2), workload)
    assert {r.decode_instance for r in two.requests} == {"colocated0", "colocated1"}
    slo = Slo(ttft_ms=200, tpot_ms=30)
    assert two.attainment(slo) >= one.attainment(slo)
    assert two.summary(slo)["median_ttft_ms"] < one.summary(slo)["median_ttft_ms"]


def test_a_placement_of_a_thousand_requests_simulates_quickly():
    import time

    config = InstanceConfig(num_kv_blocks=4000, max_num_batched_tokens=1024, max_num_seqs=128)
    spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(), config, 2),
                                             InstanceSpec("decode", Linear(), config, 2), 1000.0,
                                             Link("test", 50e9, 5e-6))
    workload = synthetic_workload(1000, 20, "64:512", "16:128", seed=1)
    start = time.perf_counter()
    result = simulate(spec, workload)
    seconds = time.perf_counter() - start
    print(f"1,000 requests over {spec.describe()}: {seconds:.2f} s")
    assert result.summary()["completed"] == 1000
    assert seconds < 5  # the target is 1 s on a quiet machine; the bound only catches a collapse


def test_bad_cluster_specs_are_refused_with_the_reason():
    config = InstanceConfig(num_kv_blocks=10)
    with pytest.raises(ValueError, match="either colocated or disaggregated"):
        ClusterSpec((InstanceSpec("colocated", Linear(), config), InstanceSpec("decode", Linear(), config)))
    with pytest.raises(ValueError, match="needs prefill and decode"):
        ClusterSpec((InstanceSpec("prefill", Linear(), config),))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        InstanceConfig(num_kv_blocks=0)
    with pytest.raises(ValueError, match="no requests"):
        simulate(ClusterSpec.colocated(Linear(), config), [])


def test_a_prompt_longer_than_the_context_is_dropped_with_the_reason_and_outputs_stop_at_the_context():
    config = InstanceConfig(num_kv_blocks=200, max_model_len=512)
    workload = [PlannedRequest(0.0, 600, 4), PlannedRequest(0.0, 500, 40)]
    result = simulate(ClusterSpec.colocated(Linear(), config), workload)
    assert "context of 512" in result.requests[0].dropped
    assert not result.requests[1].dropped and len(result.requests[1].token_times) == 12  # 500 + 12 = 512


def test_control_messages_delay_the_first_token_by_both_hops_and_decode_by_both_hops_twice():
    """One request on an idle cluster, so nothing else moves: with a dispatch latency d and an output latency o,
    the client sees the first token d + o later (to the prefill instance, back to the client) and every later one
    2(d + o) later (the decode hop is routed only once the front end has heard of the first token)."""
    config = InstanceConfig(num_kv_blocks=200, block_size=16)
    spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(0.002, 1e-5, 0), config),
                                             InstanceSpec("decode", Linear(0.01, 0, 1e-4), config), 100.0,
                                             Link("test", 1e9, 0.001))
    workload = [PlannedRequest(0.5, 120, 6)]
    plain = simulate(spec, workload).requests[0]
    slow = simulate(spec.with_control_latency(0.003, 0.0012), workload).requests[0]
    assert slow.ttft == pytest.approx(plain.ttft + 0.0042)
    assert np.subtract(slow.token_times[1:], plain.token_times[1:]) == pytest.approx([2 * 0.0042] * 5)
    assert slow.tpot > plain.tpot
    colocated = ClusterSpec.colocated(Linear(), config)
    alone = simulate(colocated, workload).requests[0]
    late = simulate(colocated.with_control_latency(0.003, 0.0012), workload).requests[0]
    assert late.ttft == pytest.approx(alone.ttft + 0.0042)
    assert late.tpot == pytest.approx(alone.tpot)
    with pytest.raises(ValueError, match="dispatch_latency_s"):
        spec.with_control_latency(-0.001, 0.0)
    with pytest.raises(ValueError, match="output_latency_s"):
        spec.with_control_latency(0.0, float("nan"))


def test_pushed_kv_leave_at_the_prefills_end_and_overlap_the_hand_over_to_decode():
    """Push: blocks reserved on the decode instance before the prefill, K/V sent as soon as the prompt is computed.
    The second token comes once both the K/V (transfer T) and the request (the front end's two hops, o + d) are
    at the decode instance: max(T, o + d) after the prefill, where pull pays o + d, then T."""
    config = InstanceConfig(num_kv_blocks=200, block_size=16)
    step = 0.01
    for transfer, hops in ((0.020, 0.004), (0.002, 0.009)):
        spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", Linear(0.002, 1e-5, 0), config),
                                                 InstanceSpec("decode", Linear(step, 0, 0), config), 0.0,
                                                 Link("test", 1e9, transfer)).with_control_latency(hops / 2, hops / 2)
        workload = [PlannedRequest(0.5, 120, 4)]
        pulled = simulate(spec, workload).requests[0]
        pushed = simulate(dataclasses.replace(spec, push=True), workload).requests[0]
        # The reservation's reply and the prompt's dispatch come first (an idle decode instance reserves at once).
        assert pushed.ttft == pytest.approx(pulled.ttft + hops)
        first_gap = pushed.token_times[1] - pushed.token_times[0]
        # From the client's first token (o after the prefill) to its second (o after the decode step).
        assert first_gap == pytest.approx(max(transfer, hops) + step)
        assert pulled.token_times[1] - pulled.token_times[0] == pytest.approx(hops + transfer + step)
        assert pushed.transfer_start == pytest.approx(pushed.token_times[0] - hops / 2)  # at the prefill's end
        assert np.diff(pushed.token_times[1:]) == pytest.approx([step] * 2)


@pytest.mark.parametrize("latency", [0.0, 0.001])
def test_a_pushed_request_the_prefill_refuses_gives_its_reserved_blocks_back(latency):
    """Push reserves decode blocks before the prefill sees the prompt: a prompt the prefill instance cannot hold is
    dropped and its reservation freed, so the requests behind it (held back or arriving later) still run; one that
    ends at its first token frees its reservation too. With and without control latency (without, the release
    happens inside the decode instance's own step)."""
    def push(prefill_blocks: int, decode_blocks: int) -> ClusterSpec:
        return dataclasses.replace(ClusterSpec.disaggregated_cluster(
            InstanceSpec("prefill", Linear(), InstanceConfig(num_kv_blocks=prefill_blocks, block_size=16)),
            InstanceSpec("decode", Linear(), InstanceConfig(num_kv_blocks=decode_blocks, block_size=16)), 100.0,
            Link("test", 1e9, 1e-4)), push=True).with_control_latency(latency, latency)

    workload = [PlannedRequest(0.0, 300, 5), PlannedRequest(0.1, 100, 5), PlannedRequest(0.2, 400, 5),
                *[PlannedRequest(0.4 + 0.01 * i, 150, 6) for i in range(8)]]
    result = simulate(push(10, 40), workload)
    assert [r.index for r in result.requests if r.dropped] == [0, 2]
    assert all("prefill0" in r.dropped for r in result.requests if r.dropped)
    for r in result.requests:
        if not r.dropped:
            assert len(r.token_times) == r.output_len and r.finished is not None
    assert result.summary()["completed"] == len(workload) - 2
    # Refused while the next request is held back for room: it runs once the reservation is given back.
    both = simulate(push(4, 10), [PlannedRequest(0.0, 150, 5), PlannedRequest(0.0, 20, 5)])
    assert bool(both.requests[0].dropped) and len(both.requests[1].token_times) == 5
    # A one-token request's reservation (10 of 20 blocks) must come back, or the 20-block request never fits.
    one = simulate(push(30, 20), [PlannedRequest(0.0, 150, 1), PlannedRequest(0.1, 300, 5)])
    assert [len(r.token_times) for r in one.requests] == [1, 5]
