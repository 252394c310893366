"""How fast the cluster simulator is on this machine: one placement with 1,000 requests, and a whole placement
search at steady state, the branch-and-bound search on every core against the exhaustive one on one core (the
baseline: how ``search_placements`` searched before it had either, but for where each search starts), measured
in the same run, interleaved, repeated.

The search is DistServe's chatbot case: OPT-13B on four A100s, prompts and answers as its released runs, TTFT
250 ms and TPOT 100 ms, every run 347 s of arrivals (``steady_duration``). The three searches must agree on the
best colocated and the best disaggregated placement (checked).

    python scripts/sim_speed.py                 # ~5 minutes on 2 cores
    python scripts/sim_speed.py --repeats 3 --json speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minipd.serve.loadgen import Slo
from minipd.serve.workload import synthetic_workload
from minipd.sim.calibrate import DISTSERVE_SHAREGPT_LENGTHS
from minipd.sim.cli import usable_cores
from minipd.sim.cluster import ClusterSpec, InstanceSpec, simulate
from minipd.sim.costs import A100_80GB, preset
from minipd.sim.instance import InstanceConfig
from minipd.sim.roofline import NVLINK3, Link
from minipd.sim.search import GpuCluster, WorkloadShape, placements, search_placements, steady_duration


class LinearStepTime:
    """The unit tests' step model: 5 ms a step and 20 µs a token (the simulator's cost, not the GPU's, is measured)."""

    def step_time(self, work) -> float:
        return 0.005 + 2e-5 * work.num_tokens


def thousand_requests() -> float:
    """Seconds to simulate 1,000 requests through 2P+2D."""
    config = InstanceConfig(num_kv_blocks=4000, max_num_batched_tokens=1024, max_num_seqs=128)
    spec = ClusterSpec.disaggregated_cluster(InstanceSpec("prefill", LinearStepTime(), config, 2),
                                             InstanceSpec("decode", LinearStepTime(), config, 2), 1000.0,
                                             Link("test", 50e9, 5e-6))
    workload = synthetic_workload(1000, 20, "64:512", "16:128", seed=1)
    start = time.perf_counter()
    assert simulate(spec, workload).summary()["completed"] == 1000
    return time.perf_counter() - start


def search(exhaustive: bool, workers: int) -> tuple[float, list]:
    prompts, outputs = DISTSERVE_SHAREGPT_LENGTHS
    slo = Slo(ttft_ms=250, tpot_ms=100)
    cluster = GpuCluster(preset("opt-13b"), A100_80GB, NVLINK3)
    shape = WorkloadShape(prompts, outputs, duration_s=steady_duration(outputs, slo))
    start = time.perf_counter()
    ranked = search_placements(placements(cluster, 4), shape, slo, verify=1, workers=workers, exhaustive=exhaustive)
    return time.perf_counter() - start, ranked


def best_of_each_kind(ranked: list) -> dict[bool, tuple[str, float]]:
    return {kind: next((r.name, r.goodput) for r in ranked if r.spec.disaggregated == kind) for kind in (False, True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=usable_cores())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from minipd.bench.hf import machine_label

    print(f"machine: {machine_label()}; {args.workers} worker processes")
    single = [thousand_requests() for _ in range(5)]
    print(f"1,000 requests through 2P+2D: min {min(single):.2f} s, median {statistics.median(single):.2f} s")
    variants = {"exhaustive, 1 process": (True, 1), f"exhaustive, {args.workers} processes": (True, args.workers),
                f"branch and bound, {args.workers} processes": (False, args.workers)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    bests = {}
    for repeat in range(args.repeats):
        for name, (exhaustive, workers) in variants.items():  # interleaved: the machine's drift hits all alike
            seconds, ranked = search(exhaustive, workers)
            times[name].append(seconds)
            bests[name] = best_of_each_kind(ranked)
            print(f"  repeat {repeat + 1}: {name}: {seconds:.1f} s", flush=True)
    assert len({json.dumps(b, sort_keys=True) for b in bests.values()}) == 1, bests
    base = statistics.median(times["exhaustive, 1 process"])
    print("placement search, OPT-13B chatbot on 4 A100s, 347 s of arrivals a run:")
    for name, values in times.items():
        print(f"  {name:<32} min {min(values):6.1f} s   median {statistics.median(values):6.1f} s   "
              f"{base / statistics.median(values):.2f}x the exhaustive search on one process")
    print("  best colocated and disaggregated (all agree):", bests["exhaustive, 1 process"])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_label(), "thousand_requests_s": single,
                                               "search_s": times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
