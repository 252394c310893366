"""The simulator studies behind chapter 05b's heavier figures, stored as JSON (the notebook reruns a small piece of
each live and checks it against the file).

0. ``figure1``: the roofline's efficiencies fitted to DistServe's Figure 1 (a 13B model on one A100: prefill
   only 5.6 req/s, decode only 10), and the colocated and 2P+1D goodputs the fit gives beside the paper's.
1. ``literature``: DistServe's setting, OPT-13B on A100s with its chatbot SLOs (TTFT 250 ms, TPOT 100 ms) and
   lengths fitted to the ShareGPT runs DistServe released: goodput per GPU of every placement of 4 GPUs (tensor
   parallel 1 or 2) and of the units on fewer GPUs that none of those is copies of (DistServe's own 1P(tp2)+1D
   on three), colocated with chunked prefill (decode-first, 2048-token budget), colocated as vLLM
   scheduled in 2023, the baseline DistServe measured against (prefill-only: a step is all prefill or all
   decode; vLLM's default budget of 2,560 tokens), and disaggregated; on three rooflines (:func:`engines`: the
   default, the one fitted to Figure 1, and one as fast as the runs DistServe released). ``released``: those runs
   (vLLM on one GPU, DistServe on 1P(tp2)+1D), rate by rate, beside the same placements simulated on the three.
   ``durations``: the goodput a search finds against the length of its runs, for the main placements on the
   released-runs roofline: short runs never build the queues of steady state.
2. ``grid``: Llama-3-8B on H100s (4 GPUs, 400G links), prompt lengths × output lengths × TPOT SLO: the best
   colocated and the best disaggregated placement and their goodput per GPU.
3. ``claims``: Llama-3-70B on 8 H100s, two tensor-parallel-4 instances colocated against one prefill and one
   decode instance, at several rates: P50/mean TTFT and TPOT, busy share of each instance (while requests
   arrive, and over the whole run).

The literature's and the grid's goodput searches run each rate for :func:`~minipd.sim.search.steady_duration` of
arrivals (20 lifetimes of a request that just meets the SLOs: 347 s for the chatbot case, 30-623 s for the grid's
cells), Figure 1's fit likewise (59 s); the claims run 118 s a rate, 20 lifetimes of a request at the article's
colocated TTFT and TPOT (150 ms, 20 ms). The exceptions are on purpose: ``released`` runs as long as DistServe's
runs did (100 s), and ``durations`` tries 20 s to twice the steady length.

    python scripts/cluster_studies.py --out assets/sim/cluster_studies.json     # ~40 minutes on 2 cores
    python scripts/cluster_studies.py --out assets/sim/cluster_studies.json --parts claims   # redo one part
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minipd.serve.loadgen import Slo
from minipd.sim.calibrate import DISTSERVE_RELEASED_RUNS, DISTSERVE_SHAREGPT_LENGTHS, calibrate
from minipd.sim.cluster import simulate
from minipd.sim.costs import A100_80GB, H100_SXM, preset
from minipd.sim.roofline import IB_400G, NVLINK3
from minipd.sim.search import (
    GpuCluster,
    WorkloadShape,
    placement_goodput,
    placements,
    search_placements,
    steady_duration,
)

REL_TOL = 0.05

LITERATURE = dict(model="opt-13b", device="A100 80GB SXM", link=NVLINK3.name, devices=4, tps=[1, 2],
                  prompts=DISTSERVE_SHAREGPT_LENGTHS[0], outputs=DISTSERVE_SHAREGPT_LENGTHS[1],
                  ttft_slo_ms=250.0, tpot_slo_ms=100.0, num_requests=150)
LITERATURE["duration_s"] = steady_duration(LITERATURE["outputs"],
                                           Slo(LITERATURE["ttft_slo_ms"], LITERATURE["tpot_slo_ms"]))
#: Run lengths (seconds of arrivals) the ``durations`` part tries; 100 s is the length of DistServe's released runs.
DURATIONS = [20.0, 50.0, 100.0, 200.0, LITERATURE["duration_s"], 2 * LITERATURE["duration_s"]]
GRID = dict(model="llama-3-8b", device="H100 SXM", link=IB_400G.name, devices=4, tps=[1],
            prompts=["128:512", "1024:2048", "3072:4096"], outputs=["16:64", "128:256", "512:1024"],
            ttft_slo_ms=450.0, tpot_slo_ms=[15.0, 40.0], num_requests=100)  # each cell its steady_duration
CLAIMS = dict(model="llama-3-70b", device="H100 SXM", link=IB_400G.name, tp=4, prompts="512:2048",
              outputs="64:512", num_requests=200, rates=[1.0, 2.0, 4.0, 6.0, 8.0, 10.0])
CLAIMS["duration_s"] = round(steady_duration(CLAIMS["outputs"], Slo(150.0, 20.0)))


PARTS = ("figure1", "literature", "durations", "grid", "claims")


def row(result) -> dict:
    return {"name": result.name, "kind": "disaggregated" if result.spec.disaggregated else "colocated",
            "goodput": result.goodput, "per_device": result.per_device, "verified": result.verified,
            "tried": result.tried}


def vllm_2023(**efficiencies: float) -> GpuCluster:
    """OPT-13B on A100s, colocated instances scheduled as vLLM was in 2023 (a step is all prefill or all decode,
    2,560 tokens a step: its default ``max_num_batched_tokens``)."""
    return GpuCluster(preset(LITERATURE["model"]), A100_80GB, NVLINK3, colocated_policy="prefill-only",
                      colocated_batched_tokens=2560, **efficiencies)


def figure1() -> dict:
    fit = calibrate(vllm_2023())
    return {"compute_efficiency": fit.cluster.compute_efficiency, "memory_efficiency": fit.cluster.memory_efficiency,
            "step_overhead_s": fit.cluster.step_overhead_s, "source": fit.figures.source,
            "rows": [{"figure": name, "published": paper, "simulated": ours} for name, paper, ours in fit.rows()]}


def engines(fit: dict) -> dict[str, dict[str, float]]:
    """The rooflines the literature is tried on: today's defaults; fitted to Figure 1 (both efficiencies); and
    as the runs DistServe released show their engines (prefill at 57-69% of peak there, i.e. the default 60%;
    decode as Figure 1's fit, whose TPOT matches those runs' at light load)."""
    return {"default": {}, "figure1": {k: fit[k] for k in ("compute_efficiency", "memory_efficiency")},
            "released": {"memory_efficiency": fit["memory_efficiency"]}}


def literature_clusters(fit: dict, engine: str) -> tuple[GpuCluster, GpuCluster]:
    """OPT-13B on A100s on one roofline of :func:`engines`: colocated instances as vLLM scheduled them in 2023,
    and with chunked prefill (decode-first, 2,048 tokens a step)."""
    baseline = vllm_2023(**engines(fit)[engine])
    return baseline, dataclasses.replace(baseline, colocated_policy="decode-first", colocated_batched_tokens=2048)


def literature_engine(fit: dict, engine: str) -> dict:
    """Every placement searched on one roofline of :func:`engines`, chunked and as vLLM in 2023."""
    p = LITERATURE
    shape = WorkloadShape(p["prompts"], p["outputs"], p["num_requests"], duration_s=p["duration_s"])
    slo = Slo(p["ttft_slo_ms"], p["tpot_slo_ms"])
    baseline, chunked = literature_clusters(fit, engine)
    found = {}
    for label, cluster, both in (("chunked", chunked, True), ("prefill_only", baseline, False)):
        specs = placements(cluster, p["devices"], tps=p["tps"], disaggregated=both, units_below=True)
        found[label] = [row(r) for r in search_placements(specs, shape, slo, rel_tol=REL_TOL, verify=2)]
    return found


def literature(found: dict[str, dict], fit: dict) -> dict:
    """The engines' searches together: the default roofline's at the top, the others under ``<engine>_engine``."""
    out: dict = {}
    for engine, knobs in engines(fit).items():
        if engine == "default":
            out.update(found[engine])
        else:
            out[f"{engine}_engine"] = {**found[engine], "efficiencies": knobs}
    return out


def duration_point(fit: dict, name: str, duration_s: float) -> dict:
    """One placement's goodput on the released-runs roofline, found with runs ``duration_s`` long."""
    p = LITERATURE
    baseline, chunked = literature_clusters(fit, "released")
    spec = {"1C": chunked.colocated(1, 1), "1C vLLM-2023": baseline.colocated(1, 1),
            "1C(tp2)": chunked.colocated(1, 2), "1P(tp2)+1D": chunked.disaggregated(1, 2, 1, 1),
            "1P(tp2)+1D(tp2)": chunked.disaggregated(1, 2, 1, 2)}[name]
    shape = WorkloadShape(p["prompts"], p["outputs"], p["num_requests"], duration_s=duration_s)
    goodput, tried = placement_goodput(spec, shape, Slo(p["ttft_slo_ms"], p["tpot_slo_ms"]), rel_tol=REL_TOL)
    return {"placement": name, "duration_s": duration_s, "goodput": goodput, "per_device": goodput / spec.devices,
            "tried": tried}


DURATION_PLACEMENTS = ("1C(tp2)", "1P(tp2)+1D(tp2)", "1C", "1C vLLM-2023", "1P(tp2)+1D")


def released(fit: dict) -> dict:
    """DistServe's released runs beside the same placements simulated, at the same rates and lengths."""
    p = LITERATURE
    slo = Slo(p["ttft_slo_ms"], p["tpot_slo_ms"])
    out = {}
    for name, runs in DISTSERVE_RELEASED_RUNS.items():
        rows = []
        for rate, count, attained, ttft, tpot in runs:
            shape = WorkloadShape(p["prompts"], p["outputs"], count, duration_s=count / rate)
            row_ = {"rate": rate, "requests": count, "real": {"attainment": attained, "median_ttft_ms": ttft,
                                                             "median_tpot_ms": tpot}}
            for engine, knobs in engines(fit).items():
                cluster = vllm_2023(**knobs)
                spec = cluster.colocated(1, 1) if name.startswith("vLLM") else cluster.disaggregated(1, 2, 1, 1)
                result = simulate(spec, shape.at(rate))
                summary = result.summary()
                row_[engine] = {"attainment": result.attainment(slo), "median_ttft_ms": summary["median_ttft_ms"],
                                "median_tpot_ms": summary["median_tpot_ms"]}
            rows.append(row_)
        out[name] = rows
    return out


def grid_cell(prompts: str, outputs: str, tpot_slo_ms: float) -> dict:
    p = GRID
    slo = Slo(p["ttft_slo_ms"], tpot_slo_ms)
    duration_s = steady_duration(outputs, slo)
    shape = WorkloadShape(prompts, outputs, p["num_requests"], duration_s=duration_s)
    cluster = GpuCluster(preset(p["model"]), H100_SXM, IB_400G)
    ranked = search_placements(placements(cluster, p["devices"], tps=p["tps"]), shape, slo, rel_tol=REL_TOL)
    return {"prompts": prompts, "outputs": outputs, "tpot_slo_ms": tpot_slo_ms, "duration_s": duration_s,
            "placements": [row(r) for r in ranked]}


def claims_point(rate: float) -> dict:
    p = CLAIMS
    cluster = GpuCluster(preset(p["model"]), H100_SXM, IB_400G)
    shape = WorkloadShape(p["prompts"], p["outputs"], p["num_requests"], duration_s=p["duration_s"])
    out = {"rate": rate}
    for label, spec in (("colocated", cluster.colocated(2, p["tp"])),
                        ("disaggregated", cluster.disaggregated(1, p["tp"], 1, p["tp"]))):
        result = simulate(spec, shape.at(rate), keep_timeline=True)
        s = result.summary()
        out[label] = {"placement": spec.describe(), "requests": len(result.requests),
                      **{k: s[k] for k in ("median_ttft_ms", "mean_ttft_ms", "p90_ttft_ms", "median_tpot_ms",
                                           "mean_tpot_ms", "p90_tpot_ms")},
                      # while requests arrive (steady state), and over the whole run with its drain
                      "busy": result.utilisation(while_arriving=True), "busy_whole_run": result.utilisation(),
                      "devices": spec.devices}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="the parts to (re)compute; the others are kept from --out when it exists")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() and set(args.parts) != set(PARTS) else {}
    report.update({"date": time.strftime("%Y-%m-%d"), "script": "scripts/cluster_studies.py", "rel_tol": REL_TOL})
    cells = [(pr, o, t) for t in GRID["tpot_slo_ms"] for pr in GRID["prompts"] for o in GRID["outputs"]]
    if "figure1" in args.parts or "figure1" not in report:
        report["figure1"] = figure1()
        print(f"figure 1 fitted ({time.perf_counter() - start:.0f} s)", flush=True)
    with ProcessPoolExecutor(args.workers) as pool:
        # The slowest pieces first, so that the pool ends together.
        fit = report["figure1"]
        lit = ({engine: pool.submit(literature_engine, fit, engine) for engine in engines(fit)}
               if "literature" in args.parts else {})
        runs = pool.submit(released, report["figure1"]) if "literature" in args.parts else None
        grid = [pool.submit(grid_cell, *cell) for cell in cells] if "grid" in args.parts else []
        durations = ([pool.submit(duration_point, report["figure1"], name, d) for name in DURATION_PLACEMENTS
                      for d in DURATIONS] if "durations" in args.parts else [])
        claims = [pool.submit(claims_point, r) for r in CLAIMS["rates"]] if "claims" in args.parts else []
        if lit and runs is not None:
            found = {engine: future.result() for engine, future in lit.items()}
            report["literature"] = {**LITERATURE, **literature(found, report["figure1"]), "released": runs.result()}
            print(f"literature ({time.perf_counter() - start:.0f} s)", flush=True)
        if durations:
            report["durations"] = {"roofline": "released", "durations_s": DURATIONS,
                                   "points": [d.result() for d in durations]}
            print(f"durations ({time.perf_counter() - start:.0f} s)", flush=True)
        if claims:
            report["claims"] = {**CLAIMS, "points": [c.result() for c in claims]}
        if grid:
            report["grid"] = {**GRID, "cells": []}
        for future in grid:
            report["grid"]["cells"].append(future.result())
            print(f"grid {len(report['grid']['cells'])}/{len(cells)} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
