"""``python -m minipd simulate``: a GPU cluster serving a model, simulated — one placement at a rate, its
goodput, or the best placement for a number of devices.

    python -m minipd simulate --model llama-3-8b --gpu h100 --placement 1P+1D --rate 8
    python -m minipd simulate --model opt-13b --gpu a100 --placement 2C --goodput --ttft-slo-ms 250 --tpot-slo-ms 100
    python -m minipd simulate --model opt-13b --gpu a100 --search 4 --json placements.json
    python -m minipd simulate --model opt-13b --gpu a100 --calibrate distserve-figure1 --search 4 \
        --prompt-lens 2:1600 --output-lens lognormal:220:1.55:1085 --ttft-slo-ms 250 --tpot-slo-ms 100

The roofline runs at 60% of the GPU's peak FLOP/s and 80% of its memory bandwidth, 1 ms of overhead a step
(``--compute-efficiency``, ``--memory-efficiency``, ``--step-overhead-ms``); ``--calibrate`` fits the first two
to a paper's published figures first (:mod:`minipd.sim.calibrate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from minipd.engine.scheduler import POLICIES
from minipd.serve.loadgen import Slo, format_summary
from minipd.serve.workload import synthetic_workload, trace_workload
from minipd.sim.calibrate import DISTSERVE_FIGURE_1, calibrate
from minipd.sim.cluster import ClusterSpec, simulate
from minipd.sim.costs import A100_80GB, H100_SXM, H200, preset
from minipd.sim.roofline import (
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_LINKS,
    DEFAULT_MEMORY_EFFICIENCY,
    DEFAULT_STEP_OVERHEAD_S,
    IB_400G,
    NVLINK4,
    PCIE5_X16,
)
from minipd.sim.search import (
    GpuCluster,
    WorkloadShape,
    placement_goodput,
    placements,
    search_placements,
    steady_duration,
)

GPUS = {"a100": A100_80GB, "h100": H100_SXM, "h200": H200}
LINKS = {"nvlink": NVLINK4, "pcie": PCIE5_X16, "ib": IB_400G}
CALIBRATIONS = {"distserve-figure1": DISTSERVE_FIGURE_1}
_PART = re.compile(r"^(\d+)([CPD])(?:\(tp(\d+)\))?$")


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS, Windows)
        return os.cpu_count() or 1


def parse_placement(text: str, cluster: GpuCluster) -> ClusterSpec:
    """``"4C"``, ``"2C(tp2)"``, ``"1P+3D"``, ``"2P(tp2)+4D"`` as a cluster of ``cluster``'s instances."""
    parts: dict[str, tuple[int, int]] = {}
    for part in text.replace(" ", "").split("+"):
        match = _PART.match(part)
        if match is None or match.group(2) in parts:
            raise ValueError(f"--placement: {text!r} is not like 4C, 2C(tp2), 1P+3D or 2P(tp2)+4D")
        parts[match.group(2)] = (int(match.group(1)), int(match.group(3) or 1))
    if set(parts) == {"C"}:
        return cluster.colocated(*parts["C"])
    if set(parts) == {"P", "D"}:
        return cluster.disaggregated(*parts["P"], *parts["D"])
    raise ValueError(f"--placement: {text!r} needs C alone, or both P and D")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipd simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b", help="a model shape from minipd.sim.costs.MODEL_PRESETS")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--link", choices=sorted(LINKS), default="nvlink",
                        help="what K/V cross from prefill to decode instances (default nvlink)")
    parser.add_argument("--layerwise", action="store_true", help="send K/V layer by layer during the prefill")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--placement", default="1P+1D", help="e.g. 4C, 2C(tp2), 1P+3D, 2P(tp2)+4D (default 1P+1D)")
    what.add_argument("--search", type=int, metavar="DEVICES",
                      help="rank every placement on this many devices by goodput per device")
    parser.add_argument("--units-below", action="store_true",
                        help="with --search, also rank the placements on fewer devices that are no copy of one on all "
                             "of them (1P(tp2)+1D on 3 of 4), as DistServe ranks the units it replicates")
    parser.add_argument("--exhaustive", action="store_true",
                        help="with --search, find every placement's goodput; by default a placement's search stops "
                             "once it has failed at a rate per device that one of its kind (colocated, "
                             "disaggregated) passed, and it is shown as a bracket")
    parser.add_argument("--workers", type=int, default=None,
                        help="with --search, placements searched at once, each in a process (default: this machine's "
                             "usable cores; the result does not depend on it)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (default 4)")
    parser.add_argument("--goodput", action="store_true", help="find the placement's goodput instead of one run")
    parser.add_argument("--num-requests", type=int, default=200,
                        help="requests of a single run; at least this many in each run of --goodput or --search")
    parser.add_argument("--duration", type=float, default=None,
                        help="--goodput and --search: seconds of arrivals in each run, whatever the rate (default: "
                             "20 lifetimes of a request that just meets the SLOs, at least 30 s, "
                             "minipd.sim.search.steady_duration; 30 s without a TPOT SLO)")
    lengths = "N, LOW:HIGH (uniform), normal:MEAN:STD[:MAX] or lognormal:MEAN:SIGMA[:MAX]"
    parser.add_argument("--prompt-lens", default="256:1024", help=f"{lengths} (default 256:1024)")
    parser.add_argument("--output-lens", default="64:256", help=f"{lengths} (default 64:256)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--trace", default=None, help="JSONL of arrival, prompt_len, output_len (instead of "
                                                      "--rate and the lengths)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=None)
    parser.add_argument("--tpot-slo-ms", type=float, default=None)
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    parser.add_argument("--chunk", type=int, default=2048, help="colocated token budget per step (default 2048)")
    parser.add_argument("--policy", choices=tuple(POLICIES), default="decode-first",
                        help="colocated scheduling (default decode-first)")
    parser.add_argument("--compute-efficiency", type=float, default=DEFAULT_COMPUTE_EFFICIENCY,
                        help=f"share of the GPU's peak FLOP/s a step reaches (default {DEFAULT_COMPUTE_EFFICIENCY:g})")
    parser.add_argument("--memory-efficiency", type=float, default=DEFAULT_MEMORY_EFFICIENCY,
                        help=f"share of its memory bandwidth (default {DEFAULT_MEMORY_EFFICIENCY:g})")
    parser.add_argument("--step-overhead-ms", type=float, default=DEFAULT_STEP_OVERHEAD_S * 1e3,
                        help=f"fixed time a step (default {DEFAULT_STEP_OVERHEAD_S * 1e3:g})")
    parser.add_argument("--dispatch-latency-ms", type=float, default=0.0,
                        help="control messages: from a request's arrival to its first instance (default 0)")
    parser.add_argument("--output-latency-ms", type=float, default=0.0,
                        help="control messages: from an instance's output to the client, and to the router of a "
                             "decode hop (default 0)")
    parser.add_argument("--calibrate", choices=sorted(CALIBRATIONS), default=None,
                        help="first fit the two efficiencies to a paper's single-phase figures (see "
                             "minipd.sim.calibrate; distserve-figure1: a 13B model on one A100)")
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("dispatch_latency_ms", "output_latency_ms"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of milliseconds >= 0, got {value}")
    device = GPUS[args.gpu]
    # "nvlink" is the device's own generation: NVLink 3 between A100s.
    link = DEFAULT_LINKS.get(device.name, NVLINK4) if args.link == "nvlink" else LINKS[args.link]
    cluster = GpuCluster(preset(args.model), device, link, layerwise=args.layerwise,
                         colocated_batched_tokens=args.chunk, colocated_policy=args.policy,
                         compute_efficiency=args.compute_efficiency, memory_efficiency=args.memory_efficiency,
                         step_overhead_s=args.step_overhead_ms / 1e3, dispatch_latency_s=args.dispatch_latency_ms / 1e3,
                         output_latency_s=args.output_latency_ms / 1e3)
    cluster.step_model(1)  # refuses efficiencies outside (0, 1] and a negative overhead before any work
    needs_slo = args.goodput or args.search is not None
    if needs_slo and args.ttft_slo_ms is None and args.tpot_slo_ms is None:
        raise ValueError("--goodput and --search need --ttft-slo-ms and/or --tpot-slo-ms")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    report: dict[str, Any] = {}
    if args.calibrate:
        fit = calibrate(cluster, CALIBRATIONS[args.calibrate], progress=True)
        print(fit.describe())
        cluster = dataclasses.replace(cluster, compute_efficiency=fit.cluster.compute_efficiency,
                                      memory_efficiency=fit.cluster.memory_efficiency)
        report["calibration"] = {"figures": args.calibrate, "compute_efficiency": cluster.compute_efficiency,
                                 "memory_efficiency": cluster.memory_efficiency,
                                 "rows": [{"figure": n, "published": p, "simulated": s} for n, p, s in fit.rows()]}
    slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
    duration = args.duration
    if duration is None:
        duration = steady_duration(args.output_lens, slo) if slo.tpot_ms is not None else 30.0
    elif not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"--duration must be a finite number of seconds > 0, got {duration}")
    shape = WorkloadShape(args.prompt_lens, args.output_lens, args.num_requests, args.burstiness, args.seed,
                          duration)
    if needs_slo:
        print(f"each run: {duration:.0f} s of arrivals", file=sys.stderr)
    report.update({"model": args.model, "gpu": device.name, "link": link.name, "layerwise": args.layerwise,
                   "slo": vars(slo), "duration_s": duration, "compute_efficiency": cluster.compute_efficiency,
                   "memory_efficiency": cluster.memory_efficiency, "step_overhead_s": cluster.step_overhead_s,
                   "dispatch_latency_s": cluster.dispatch_latency_s, "output_latency_s": cluster.output_latency_s})
    if args.search is not None:
        started = time.perf_counter()
        workers = usable_cores() if args.workers is None else args.workers
        ranked = search_placements(placements(cluster, args.search, units_below=args.units_below), shape, slo,
                                   args.attainment, verify=1, progress=True, workers=workers,
                                   exhaustive=args.exhaustive)
        print(f"searched {len(ranked)} placements in {time.perf_counter() - started:.1f} s "
              f"(on up to {workers} process{'es' if workers > 1 else ''})", file=sys.stderr)
        print(f"{args.model} on {args.search} x {device.name}, link {link.name}: "
              f"goodput at {args.attainment:.0%} within TTFT {args.ttft_slo_ms} ms / TPOT {args.tpot_slo_ms} ms")
        for result in ranked:
            if result.upper is None:
                note = "" if result.verified is None else \
                    f"   (whole placement at that rate: {result.verified:.0%} met)"
                print(f"  {result.name:<22} {result.goodput:8.2f} req/s   {result.per_device:7.2f} req/s per device"
                      + note)
            else:  # (a bracket: failed at the upper end, where another of its kind passed)
                print(f"  {result.name:<22} {'< ' + format(result.upper, '.2f'):>8} req/s   "
                      f"{'< ' + format(result.upper_per_device, '.2f'):>7} req/s per device   (at least "
                      f"{result.per_device:.2f}; below the best of its kind, not searched further)")
        report["placements"] = [{"placement": r.name, "goodput": r.goodput, "per_device": r.per_device,
                                 "upper": r.upper, "tried": r.tried, "verified": r.verified} for r in ranked]
    else:
        spec = parse_placement(args.placement, cluster)
        if args.goodput:
            rate, tried = placement_goodput(spec, shape, slo, start=args.rate, attainment=args.attainment)
            print(f"{spec.describe()}: goodput {rate:.2f} req/s ({rate / spec.devices:.2f} per device)")
            report.update(placement=spec.describe(), goodput=rate, tried=tried)
        else:
            workload = trace_workload(args.trace) if args.trace else synthetic_workload(
                args.num_requests, args.rate, args.prompt_lens, args.output_lens, args.burstiness, args.seed)
            result = simulate(spec, workload, progress=True)
            summary = result.summary(slo if needs_slo or args.ttft_slo_ms or args.tpot_slo_ms else None)
            print(f"{spec.describe()} at {args.rate} req/s:")
            print(format_summary(summary))
            for name, share in result.utilisation().items():
                print(f"  {name}: busy {share:.0%}")
            report.update(placement=spec.describe(), utilisation=result.utilisation(),
                          summary={k: v for k, v in summary.items() if not isinstance(v, list)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


__all__ = ["build_parser", "main", "parse_placement"]
