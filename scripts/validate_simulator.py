"""The simulator against minipd's real engine on this machine: colocated and 1P1D, Poisson rates up to near capacity.

For each engine (an ``LLM``, and a ``DisaggregatedLLM`` with one prefill and one decode worker), on tiny-py:

1. a saturating run (every request at once) measures capacity (requests/s);
2. calibration runs at 30%, 60% and 95% of capacity (their own seeds, each just before step 3's runs at its
   load) fit the step-time models (``FittedStepTime``, on each step's time with its loop's own work before the
   next step, ``minipd.sim.fitted.cycle_times``; per worker for 1P1D, the KV link from the measured
   transfers, and the control messages' latency between the front end and the workers); held-out steps give
   the model's error (MAPE) beside the noise floor (identical steps' own spread on this machine), on the steps'
   wall times and on their time on a core (each step's wait for one, which the engine measures, left out);
3. runs at 30%, 60%, 85% and 95% of capacity, each five times for real (``--repeats``: how much the machine alone
   moves the latencies; the first run is compared figure by figure, and the median of all of them too, beside how
   close each real run comes to the median of the others) and once simulated: P50/P90 TTFT and TPOT and SLO
   attainment, and the share of each engine's or worker's step time spent waiting for a core (1P1D: the K/V pushed
   as the engine pushes them, and a second simulation beside, ``shared_cores``, whose workers slow each other down
   on the shared cores: ``minipd.sim.sharing``); and once more with the step models at the speed the machine ran
   that real run (one factor per engine or worker, ``minipd.sim.fitted.speed_factor``): a shared machine's speed
   drifts by 10-20% over minutes, and this separates that drift from the simulator's own error; once more for each
   real run and its repeat with that run's own stalls put back (``minipd.sim.stalls``: the machine between its stops
   at the run's speed, the stops where they were: what is left is the simulator's); once more for each with the
   waits for a core the engine measured put back in their steps, on a model of the steps' time on a core
   (``replay_run_waits``: measured, where the stalls are inferred); once with stalls drawn at random at the rate and
   of the lengths the calibration runs had (``stalls_drawn``: a prediction, borrowing nothing from the run); and on
   a machine 5% faster and 5% slower (how much each figure moves with the speed alone);
4. goodput (90% of requests within the SLOs) found by the same search on the real engine (twice) and on the
   simulator (also at the speed of the first real search's runs, and with each of those runs' stalls, and their
   waits for a core; and for each second model simulated beside: ``shared_cores``, ``stalls_drawn``).

    python scripts/validate_simulator.py --out assets/sim/cpu_validation.json --runs-out /tmp/runs.json.gz
    # the simulated side again, after a change to the simulator, beside the same real runs (a minute):
    python scripts/validate_simulator.py --from-runs assets/sim/cpu_validation.json /tmp/runs.json.gz --out new.json

Keep the machine otherwise idle while it runs (8–15 minutes on 2 cores; 8 with five runs a load here).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from minipd import LLM
from minipd.kernels.isa import cpu_identity, cpu_model
from minipd.pd.llm import DisaggregatedLLM
from minipd.serve.loadgen import Slo, summarize
from minipd.serve.workload import synthetic_workload
from minipd.sim.cli import usable_cores
from minipd.sim.cluster import ClusterSpec, InstanceSpec, simulate
from minipd.sim.fitted import FittedStepTime, held_out_split, noise_floor, speed_factor, timed_steps
from minipd.sim.search import find_goodput
from minipd.sim.sharing import fit_shared, shared_errors, step_overlaps
from minipd.sim.stalls import (
    RunStalls,
    StallingStepTime,
    draw_stalls,
    find_stalls,
    fit_between_stalls,
    replay_run_stalls,
    replay_run_waits,
    without_stalls,
)
from minipd.sim.validate import (
    RealRun,
    against_runs,
    compare,
    figure_error,
    fit_control_latency,
    fit_link,
    instance_config,
    run_engine,
)

PROMPTS, OUTPUTS = "16:256", "8:64"
FRACTIONS = (0.3, 0.6, 0.85, 0.95)
CALIBRATION = (0.3, 0.6, 0.95)
#: Real runs of each compared row: one run is one sample of a shared machine.
REPEATS = 5
#: How far ahead stalls are drawn for a simulation (seconds; the longest here lasts about ten).
STALL_HORIZON_S = 600.0
#: Step models this many times slower, to show how much each figure moves with the machine's speed.
SENSITIVITY = (0.95, 1.05)


def cpu_label() -> str:
    """The CPU as the reports name it: its model name, its generation where Linux gives one (a virtual machine
    may call a Zen 4 and a Zen 5 both "AMD EPYC") and the cores this script had."""
    identity = cpu_identity()
    usable, total = usable_cores(), os.cpu_count()
    cores = f"{usable} cores" if usable == total else f"{usable} of its {total} cores"
    return f"{cpu_model()}{f' ({identity})' if identity else ''}, {cores}"


def source_version() -> str:
    """The commit this script's simulator is (with "+changes" if the tree differs from it), or "unknown"."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def workload(n: int, rate: float, seed: int) -> list:
    return synthetic_workload(n, rate, PROMPTS, OUTPUTS, seed=seed)


def measure(engine, n: int, slo: Slo, label: str, repeats: int = REPEATS) -> dict:
    """The real side: capacity, calibration runs, every compared run (``repeats`` times) and the goodput searched
    twice."""
    print(f"== {label}", flush=True)
    run_engine(engine, workload(8, 100.0, 99))  # warm-up
    saturating = run_engine(engine, workload(n, 1e6, 7))
    capacity = n / max(r.intended + r.e2el for r in saturating.results)
    # Calibrated across loads (small, medium and big steps all seen), on seeds the comparisons do not use, each
    # calibration run taken just before the compared runs at its load: a shared machine's speed drifts by several
    # percent over minutes, and a model fitted on the first minutes would be judged on the later ones.
    calibration, measured = [], {}
    for fraction in FRACTIONS:
        if fraction in CALIBRATION:
            calibration.append(run_engine(engine, workload(n, fraction * capacity, 100 + CALIBRATION.index(fraction))))
        items = workload(n, fraction * capacity, int(fraction * 100))
        measured[fraction] = tuple(run_engine(engine, items) for _ in range(repeats))

    # The real search twice over the same workloads, as each row is run more than once: near the knee attainment
    # moves by a few points from run to run, and the bisection's answer with it.
    searched: list[RealRun] = []  # (the first search's runs: how fast the machine was while it ran)

    def searched_run(rate: float) -> list:
        searched.append(run_engine(engine, workload(n, rate, 200)))
        return searched[-1].results

    real_goodput, real_tried = search(searched_run, slo, capacity)
    again_goodput, again_tried = search(lambda r: run_engine(engine, workload(n, r, 200)).results, slo, capacity)
    goodput = {"real": real_goodput, "repeat": again_goodput, "real_tried": real_tried, "repeat_tried": again_tried}
    return {"capacity": capacity, "calibration": calibration, "measured": measured, "goodput": goodput,
            "searched": searched}


def stored(report: dict, runs: dict) -> dict:
    """:func:`measure`'s answer from an earlier report and the runs it kept (``--runs-out``)."""
    goodput = {k: report["goodput"][k] for k in ("real", "repeat", "real_tried", "repeat_tried")}
    return {"capacity": report["capacity"], "calibration": [RealRun.from_json(r) for r in runs["calibration"]],
            "measured": {float(f): tuple(RealRun.from_json(r) for r in kept) for f, kept in runs["measured"].items()},
            "goodput": goodput, "searched": [RealRun.from_json(r) for r in runs.get("searched", [])]}


def search(run_at, slo: Slo, capacity: float):
    return find_goodput(run_at, slo, start=0.5 * capacity, rel_tol=0.05, max_runs=8)


def step_counts(per_worker: dict[str, int]) -> dict[str, int]:
    """Steps per role (``prefill``, ``decode``, or ``engine`` for a colocated engine) from steps per worker or
    simulated instance (``"prefill0"``; a real colocated engine's steps name none, a simulated one is
    ``"colocated0"``)."""
    counts: Counter[str] = Counter()
    for name, count in per_worker.items():
        role = name.rstrip("0123456789")
        counts["engine" if role in ("", "colocated") else role] += count
    return dict(counts)


def between_stalls(model: FittedStepTime, samples: list) -> dict:
    """The step model's held-out error (and the noise floor) on the steps the machine did not stall in: the
    samples less those :func:`~minipd.sim.stalls.without_stalls` leaves out (their share kept beside)."""
    kept = without_stalls(model, samples)
    train, test = held_out_split(kept)
    return {"mape": FittedStepTime.fit(train, model.splits).mape(test), "noise_floor": noise_floor(kept),
            "stalled_share": 1 - len(kept) / len(samples)}


def on_core_samples(runs_steps: list[list]) -> list | None:
    """Each step of these runs (one engine's or worker's steps each) as ``(work, seconds on a core)``; None for runs
    made before the engine measured its waits for a core."""
    try:
        return [x for steps in runs_steps for x in timed_steps(steps, on_core=True)]
    except ValueError:
        return None


def on_core(runs_steps: list[list], splits) -> dict | None:
    """The step model fitted to each step's time on a core (its thread's wait for one left out,
    ``StepStats.cpu_wait``): held-out MAPE and noise floor, as for the wall times, and the share of the steps'
    time spent waiting for a core; None for runs made before the waits were measured."""
    samples = on_core_samples(runs_steps)
    if samples is None:
        return None
    wall = sum(t for steps in runs_steps for _, t in timed_steps(steps))
    train, test = held_out_split(samples)
    return {"mape": FittedStepTime.fit(train, splits).mape(test), "noise_floor": noise_floor(samples),
            "wait_share": 1.0 - sum(t for _, t in samples) / wall}


def drawn_stalls(model: FittedStepTime, runs: list, steps_of, seed: int) -> StallingStepTime:
    """``model`` fitted again between the calibration ``runs``' stalls, with stalls drawn at random at the rate and
    of the lengths those runs had (``minipd.sim.stalls.draw_stalls``): a prediction of the machine's stops, where
    the replays borrow the compared run's. ``steps_of(run)``: the engine's or worker's steps in it."""
    between = fit_between_stalls(model, [x for r in runs for x in timed_steps(steps_of(r))])
    found = [s for r in runs for s in find_stalls(between, steps_of(r), r.start)]
    span = sum(max(s.start_time + s.duration for s in steps_of(r)) - r.start for r in runs)
    return StallingStepTime(between, draw_stalls(found, span, STALL_HORIZON_S, seed))


def fit_on_core(model: FittedStepTime, runs_steps: list[list]) -> FittedStepTime | None:
    """``model`` fitted again (same ranges) to the steps' time on a core in these runs (``replay_run_waits``'s
    model); None for runs made before the engine measured its waits for a core."""
    samples = on_core_samples(runs_steps)
    return None if samples is None else FittedStepTime.fit(samples, model.splits, source=model.source)


def wait_shares(run: RealRun) -> dict[str, float] | None:
    """The share of each engine's or worker role's step time spent waiting for a core in ``run``; None for a run
    made before the waits were measured."""
    if any(s.cpu_wait is None for s in run.steps):
        return None
    groups: dict[str, list] = {}
    for s in run.steps:
        groups.setdefault(s.worker.rstrip("0123456789") or "engine", []).append(s)
    return {name: sum(s.cpu_wait for s in steps) / sum(t for _, t in timed_steps(steps))
            for name, steps in groups.items()}


def stall_figures(found: RunStalls) -> dict:
    """What :func:`~minipd.sim.stalls.replay_run_stalls` (or ``replay_run_waits``) found, as the report keeps it."""
    return {"factor": found.factor, "stalls": found.stalls, "stalled_ms": found.stalled_s * 1e3}


def simulated_side(table: dict) -> dict:
    """A :func:`~minipd.sim.validate.compare` table's simulated figures and their errors (the real side is the
    row's own), as a row keeps a second simulation beside its first."""
    return {key: {"sim": row["sim"], "error": row["error"]} for key, row in table.items()}


def describe_errors(table: dict) -> str:
    return ", ".join(f"{k} {v['sim']:.3g} ({v['error']:+.2f})" for k, v in table.items())


def describe_stalls(name: str, found: dict, kind: str = "stalls") -> str:
    return f"{name} x{found['factor']:.3f}, {found['stalls']} {kind} {found['stalled_ms']:.0f} ms"


class _OffThePath(Exception):
    """The simulated search asked for a rate the real search never ran."""


def replayed_search(real: dict, replay_run, make_spec, n: int, slo: Slo) -> dict:
    """The goodput search once more, each rate simulated with the stalls (or waits for a core) of the real search's
    run at that rate (the same bisection: while the two agree on each rate, they try the same rates). Returns the
    goodput (None if the simulation passed or failed a rate the other way and asked for one never run for real)
    and every (rate, real attainment, simulated attainment)."""
    by_rate = {rate: run for (rate, _), run in zip(real["goodput"]["real_tried"], real["searched"], strict=True)}
    attained = dict(real["goodput"]["real_tried"])
    tried = []

    def run_at(rate: float) -> list:
        if rate not in by_rate:
            raise _OffThePath(rate)
        replayed, _ = replay_run(by_rate[rate])
        results = simulate(make_spec(replayed), workload(n, rate, 200)).results()
        tried.append((rate, attained[rate], summarize(results, slo)["slo_attainment"]))
        return results

    try:
        goodput, _ = search(run_at, slo, real["capacity"])
    except _OffThePath:
        goodput = None
    return {"goodput": goodput, "tried": tried}


def judge(real: dict, make_spec, fit, rescale, n: int, slo: Slo, variants=None, replays=None, scale=None) -> dict:
    """The simulated side, beside :func:`measure`'s. ``variants``: by name, ``make_variant(models, calibration) ->
    spec``, other models simulated beside, each one's table kept in each row under its name and its goodput
    searched too ("sim_" + name). ``rescale(models, runs) -> (models, factors)``: the step
    models at the speed the machine ran ``runs`` (:func:`minipd.sim.fitted.speed_factor`), for the
    speed-corrected simulation kept beside each row ("speed_corrected") and the goodput ("sim_speed_corrected").
    ``replays``: by name, ``replay(models, calibration) -> replay_run`` (None when the runs cannot be replayed so),
    ``replay_run(run) -> (models, found)``: "stalls", the step models of the machine between its stalls (fitted
    once), at ``run``'s speed, with ``run``'s own stalls put back (:mod:`minipd.sim.stalls`); "waits", the models
    of the steps' time on a core with each step's measured wait for one put back; each kept beside each row for
    each of its two real runs ("stalls_replayed", "repeat_stalls_replayed", ...) and run through the goodput
    search ("sim_stalls_replayed", ...). ``scale(models, factor)``: every
    step model ``factor`` times slower, for how much a 5% faster or slower machine moves each figure
    ("sensitivity": the relative change of each figure, the attainment's in points)."""
    capacity = real["capacity"]
    models, errors = fit(real["calibration"])
    spec = make_spec(models)
    variant_specs = {name: make(models, real["calibration"]) for name, make in (variants or {}).items()}
    replay_runs = {kind: replay(models, real["calibration"]) for kind, replay in (replays or {}).items()}
    replay_runs = {kind: replay_run for kind, replay_run in replay_runs.items() if replay_run is not None}
    print(f"capacity {capacity:.1f} req/s; step model MAPE (held out) and noise floor {errors}", flush=True)
    rows = []
    for fraction, real_runs in real["measured"].items():
        first, again = real_runs[:2]
        rate = fraction * capacity
        items = workload(n, rate, int(fraction * 100))
        simulated = simulate(spec, items)
        table = compare(first.results, simulated, slo)
        repeat = compare(first.results, again.results, slo)
        for key, row in table.items():
            row["repeat"], row["repeat_error"] = repeat[key]["sim"], repeat[key]["error"]
        # How many steps each engine or worker took: the same tokens in fewer, bigger prefill steps is a longer
        # TTFT for every prompt in them.
        steps = {"real": step_counts(Counter(s.worker for s in first.steps)),
                 "repeat": step_counts(Counter(s.worker for s in again.steps)),
                 "sim": step_counts({name: stats.steps for name, stats in simulated.instances.items()})}
        rows.append({"fraction": fraction, "rate": rate, **table, "steps": steps})
        print(f"{fraction:.0%} ({rate:.1f} req/s), real/again/sim: " + ", ".join(
            f"{k} {v['real']:.3g}/{v['repeat']:.3g}/{v['sim']:.3g}" for k, v in table.items()), flush=True)
        if len(real_runs) > 2:
            # One run is one sample of the machine: the simulation against the median of every real run, and each
            # real run against the median of the others (how close the machine lets a run come to its siblings);
            # also at the speed the machine ran all of them.
            results = [run.results for run in real_runs]
            pooled = against_runs(results, simulated, slo)
            pooled_models, pooled_factors = rescale(models, list(real_runs))
            pooled_at_speed = against_runs(results, simulate(make_spec(pooled_models), items), slo)
            rows[-1]["pooled"] = {**pooled, "at_speed": {"factors": pooled_factors, **{
                k: pooled_at_speed[k] for k in ("sim", "errors", "within_targets")}}}
            print(f"  against the median of {len(real_runs)} real runs: within every target "
                  f"{'yes' if pooled['within_targets'] else 'no'} ("
                  + ", ".join(f"{k} {v:+.2f}" for k, v in pooled["errors"].items())
                  + f"); at their speed {'yes' if pooled_at_speed['within_targets'] else 'no'}; real runs within "
                  f"every target of the others' median: {pooled['real_within']} of {len(real_runs)}", flush=True)
        waits = {"real": wait_shares(first), "repeat": wait_shares(again)}
        if waits["real"] is not None:
            rows[-1]["cpu_wait"] = waits
            print("  step time spent waiting for a core, real/again: " + ", ".join(
                f"{k} {v:.1%}/{waits['repeat'].get(k, 0.0):.1%}" for k, v in waits["real"].items()), flush=True)
        # The same models at the speed the machine ran this run (one factor per engine or worker): what is left
        # of the error is the simulator's, not the shared machine's drift between calibration and this run.
        at_speed, factors = rescale(models, [first])
        corrected = compare(first.results, simulate(make_spec(at_speed), items), slo)
        rows[-1]["speed_corrected"] = {"factors": factors, **simulated_side(corrected)}
        print(f"  at the run's speed ({', '.join(f'{k} x{v:.3f}' for k, v in factors.items())}): "
              + describe_errors(corrected), flush=True)
        if scale is not None:
            plain = summarize(simulated.results(), slo)
            rows[-1]["sensitivity"] = {}
            for factor in SENSITIVITY:
                moved = summarize(simulate(make_spec(scale(models, factor)), items).results(), slo)
                rows[-1]["sensitivity"][str(factor)] = {
                    k: figure_error(k, moved[k], plain[k]) for k in table}
            print("  a machine 5% faster / slower: " + ", ".join(
                f"{k} {rows[-1]['sensitivity'][str(SENSITIVITY[0])][k]:+.2f}/"
                f"{rows[-1]['sensitivity'][str(SENSITIVITY[1])][k]:+.2f}" for k in table), flush=True)
        for kind, replay_run in replay_runs.items():
            for key, run in ((f"{kind}_replayed", first), (f"repeat_{kind}_replayed", again)):
                replayed, found = replay_run(run)
                table_replayed = compare(run.results, simulate(make_spec(replayed), items), slo)
                rows[-1][key] = {"found": found, **simulated_side(table_replayed)}
                stalls = ", ".join(describe_stalls(k, v, kind) for k, v in found.items())
                print(f"  {key.replace('_', ' ')} ({stalls}): " + describe_errors(table_replayed), flush=True)
        for name, variant_spec in variant_specs.items():
            other = compare(first.results, simulate(variant_spec, items), slo)
            rows[-1][name] = simulated_side(other)
            print(f"  {name}: " + describe_errors(other), flush=True)
    sim_goodput, sim_tried = search(lambda r: simulate(spec, workload(n, r, 200)).results(), slo, capacity)
    goodput = {**real["goodput"], "sim": sim_goodput, "sim_tried": sim_tried}
    print(f"goodput real {goodput['real']:.2f}, real again {goodput['repeat']:.2f}, simulated {sim_goodput:.2f} req/s",
          flush=True)
    if real["searched"]:  # (reports from before the search's runs were kept have none)
        at_speed, factors = rescale(models, real["searched"])
        corrected_spec = make_spec(at_speed)
        goodput["sim_speed_corrected"], goodput["sim_speed_corrected_tried"] = search(
            lambda r: simulate(corrected_spec, workload(n, r, 200)).results(), slo, capacity)
        goodput["search_speed_factors"] = factors
        print(f"  at the real search's speed ({', '.join(f'{k} x{v:.3f}' for k, v in factors.items())}): "
              f"simulated {goodput['sim_speed_corrected']:.2f} req/s", flush=True)
    for name, variant_spec in variant_specs.items():
        goodput[f"sim_{name}"], goodput[f"sim_{name}_tried"] = search(
            lambda r, spec=variant_spec: simulate(spec, workload(n, r, 200)).results(), slo, capacity)
        print(f"  {name}: simulated {goodput[f'sim_{name}']:.2f} req/s", flush=True)
    for kind, replay_run in replay_runs.items() if real["searched"] else ():
        goodput[f"sim_{kind}_replayed"] = replayed_search(real, replay_run, make_spec, n, slo)
        print(f"  each real search run's own {kind} replayed: {goodput[f'sim_{kind}_replayed']}", flush=True)
    runs = {"calibration": [run.to_json() for run in real["calibration"]],
            "measured": {str(f): [run.to_json() for run in kept] for f, kept in real["measured"].items()},
            "searched": [run.to_json() for run in real["searched"]]}
    return {"capacity": capacity, "step_model": errors, "rows": rows, "goodput": goodput, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs-out", help="also write every real run's steps and latencies here (.json.gz), "
                                           "to fit other models to them later")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"real runs of each compared row (at least 2; default {REPEATS}): the simulation is also "
                             "judged against their median, and each of them against the others")
    parser.add_argument("--cpus", help="run on these cores only, e.g. 2,3 (this process, the workers it starts and "
                                       "torch's threads): two cores of a bigger machine, as on the development one")
    parser.add_argument("--ttft-slo-ms", type=float, default=100.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=15.0)
    parser.add_argument("--from-runs", nargs=2, metavar=("REPORT", "RUNS"),
                        help="run no workload: simulate again beside the real runs an earlier report (--out) and its "
                             "runs (--runs-out) hold, with this version of the simulator (the report's request count "
                             "and SLOs are used; the engines, started for their settings only, must be configured "
                             "as the report's were)")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error(f"--repeats must be at least 2 (a real run and its repeat), got {args.repeats}")
    if args.cpus:
        if not hasattr(os, "sched_setaffinity"):
            parser.error("--cpus needs an operating system that pins processes to cores (Linux); leave it out here")
        usable = os.sched_getaffinity(0)
        try:
            cpus = {int(c) for c in args.cpus.split(",")}
        except ValueError:
            cpus = set()
        if not cpus or not cpus <= usable:
            parser.error(f"--cpus must list cores of this machine, e.g. 2,3 (usable here: {sorted(usable)}), "
                         f"got {args.cpus!r}")
        os.sched_setaffinity(0, cpus)  # (inherited by the workers the disaggregated engine spawns)
        import torch

        torch.set_num_threads(len(cpus))
    slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
    now = time.gmtime()
    report: dict = {"machine": cpu_label(), "date": time.strftime("%Y-%m-%d", now),
                    "started": time.strftime("%H:%M UTC", now), "simulator": source_version(), "prompts": PROMPTS,
                    "outputs": OUTPUTS, "num_requests": args.num_requests, "slo": vars(slo)}
    earlier = earlier_runs = None
    if args.from_runs:
        earlier = json.loads(Path(args.from_runs[0]).read_text())
        earlier_runs = json.loads(gzip.decompress(Path(args.from_runs[1]).read_bytes()))
        # (The real runs' own date and start; a report from before starts were kept says nothing of its start.)
        report.update({k: earlier[k] for k in ("machine", "date", "prompts", "outputs", "num_requests", "slo")},
                      started=earlier.get("started"),
                      simulated_again=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        slo, args.num_requests = Slo(**earlier["slo"]), earlier["num_requests"]
        if (earlier["prompts"], earlier["outputs"]) != (PROMPTS, OUTPUTS):
            raise SystemExit(f"--from-runs: the runs drew lengths {earlier['prompts']} / {earlier['outputs']}, this "
                             f"script draws {PROMPTS} / {OUTPUTS}: the simulated workloads would not be theirs")

    def real_side(engine, label: str, key: str, settings: dict) -> dict:
        """The real runs: made now, or read back (``--from-runs``) when the engine is set up as it was for them."""
        report[key] = {"settings": settings}
        if earlier is None:
            return measure(engine, args.num_requests, slo, label, args.repeats)
        print(f"== {label} (stored runs)", flush=True)
        # (Reports from before the settings were kept: the engine as it described itself, less the one field it
        # only learns while running.)
        then = earlier[key].get("settings") or re.sub(r"one_thread_up_to_tokens=\d+", "", earlier[key]["engine"])
        now = settings if "settings" in earlier[key] else re.sub(r"one_thread_up_to_tokens=\d+", "", repr(engine))
        if json.loads(json.dumps(then)) != json.loads(json.dumps(now)):
            raise SystemExit(f"--from-runs: the runs were made with {then}, the engine now is set up with {now}: "
                             "simulating them with these settings would not be simulating those runs")
        return stored(earlier[key], earlier_runs[key])

    llm = LLM("tiny-py", enable_prefix_caching=False)
    config = instance_config(llm)
    small = llm.engine.core.small_step_tokens
    if earlier is not None:
        # The engine measures how large a step it runs on one thread when it starts, and that moves with the
        # machine's load: the stored runs' own value, not today's, for the ranges their steps fall into.
        kept = earlier["colocated"].get("splits")
        small = kept[1] if kept else int(re.search(r"one_thread_up_to_tokens=(\d+)", earlier["colocated"]["engine"])[1])
    kv_per_token, layers = llm.kv_bytes_per_token, llm.config.num_hidden_layers

    splits = (1, small, 32, 128)

    def fit_colocated(runs):
        samples = [x for run in runs for x in timed_steps(run.steps)]
        train, test = held_out_split(samples)
        model = FittedStepTime.fit(samples, splits, source=f"tiny-py colocated, {report['machine']}")
        return model, {"mape": FittedStepTime.fit(train, splits).mape(test), "noise_floor": noise_floor(samples),
                       "model": model.describe(), "between_stalls": between_stalls(model, samples),
                       "on_core": on_core([run.steps for run in runs], splits)}

    def rescale_colocated(model, runs):
        factor = speed_factor(model, [x for run in runs for x in timed_steps(run.steps)])
        return model.scaled(factor), {"engine": factor}

    def replay_colocated(model, calibration):
        between = fit_between_stalls(model, [x for r in calibration for x in timed_steps(r.steps)])

        def replay_run(run):
            replayed, found = replay_run_stalls(between, run.steps, run.start)
            return replayed, {"engine": stall_figures(found)}

        return replay_run

    def replay_colocated_waits(model, calibration):
        on_core_model = fit_on_core(model, [r.steps for r in calibration])
        if on_core_model is None:
            return None

        def replay_run(run):
            replayed, found = replay_run_waits(on_core_model, run.steps, run.start)
            return replayed, {"engine": stall_figures(found)}

        return replay_run

    real = real_side(llm, "colocated (LLM)", "colocated", dataclasses.asdict(config))
    report["colocated"].update(judge(real, lambda m: ClusterSpec.colocated(m, config), fit_colocated,
                                     rescale_colocated, args.num_requests, slo,
                                     variants={"stalls_drawn": lambda m, runs: ClusterSpec.colocated(
                                         drawn_stalls(m, runs, lambda r: r.steps, 0), config)},
                                     replays={"stalls": replay_colocated, "waits": replay_colocated_waits},
                                     scale=lambda model, factor: model.scaled(factor)))
    # (Simulated again: the engine the runs were made with.)
    report["colocated"]["engine"] = repr(llm) if earlier is None else earlier["colocated"]["engine"]
    report["colocated"]["splits"] = splits
    llm.close()

    with DisaggregatedLLM("tiny-py", enable_prefix_caching=False) as pd:
        blocks = {w.role: w.num_blocks for w in pd.workers.workers.values()}

        engines = pd.describe()
        # (A decode worker's steps are small, one thread each, their cost not linear in rows from 1 to 128: ranges
        # finer at the small end than the colocated engine's, whose steps of up to 32 tokens take one thread.)
        decode_splits = (1, 4, 32, 128)

        def role_steps(run, role):
            return [s for s in run.steps if s.worker.startswith(role)]

        def fit_pd(runs):
            models, errors = {}, {}
            for role in ("prefill", "decode"):
                samples, overlaps = [], []
                for run in runs:
                    mine = role_steps(run, role)
                    others = [s for s in run.steps if s.worker and not s.worker.startswith(role)]
                    samples += timed_steps(mine)
                    overlaps += step_overlaps(mine, [others])
                # (Prefill steps are all big: one range. Decode steps are small: the finer ranges above.)
                ranges = () if role == "prefill" else decode_splits
                train, test = held_out_split(list(zip(samples, overlaps, strict=True)))
                train_samples, test_samples = [x for x, _ in train], [x for x, _ in test]
                models[role] = FittedStepTime.fit(samples, ranges)
                # The variant: the two workers share this machine's cores, each step's time alone and how much
                # the other worker's steps beside it slow it fitted together (minipd.sim.sharing).
                models[f"{role} shared"] = fit_shared(samples, overlaps, ranges)
                held = fit_shared(train_samples, [o for _, o in train], ranges)
                errors[role] = {"mape": FittedStepTime.fit(train_samples, ranges).mape(test_samples),
                                "noise_floor": noise_floor(samples), "model": models[role].describe(),
                                "between_stalls": between_stalls(models[role], samples),
                                "on_core": on_core([role_steps(run, role) for run in runs], ranges),
                                "shared_cores": {
                                    "mape": float(np.abs(shared_errors(*held, test_samples,
                                                                       [o for _, o in test])).mean()),
                                    "sharing_slowdown": models[f"{role} shared"][1],
                                    "overlapped_share": sum(overlaps) / sum(t for _, t in samples)}}
            models["link"] = fit_link([t for run in runs for t in run.transfers])
            errors["link"] = {"bandwidth": models["link"].bandwidth, "latency_s": models["link"].latency_s}
            models["control"] = fit_control_latency(runs, push=engines["kv_transfer"] != "pull")
            errors["control"] = {"dispatch_s": models["control"][0], "output_s": models["control"][1]}
            return models, errors

        def scaled_pd(models, factors):
            return {**models, **{role: models[role].scaled(f) for role, f in factors.items()}}

        def rescale_pd(models, runs):
            factors = {role: speed_factor(models[role], [x for run in runs for x in timed_steps(role_steps(run, role))])
                       for role in ("prefill", "decode")}
            return scaled_pd(models, factors), factors

        def replay_roles(models, fitted, replay):
            """``replay_run`` for 1P1D: each worker's model from ``fitted[role]`` through ``replay(fitted, steps,
            origin)`` (``replay_run_stalls`` or ``replay_run_waits``)."""

            def replay_run(run):
                replayed, found = dict(models), {}
                for role in ("prefill", "decode"):
                    replayed[role], stalls = replay(fitted[role], role_steps(run, role), run.start)
                    found[role] = stall_figures(stalls)
                return replayed, found

            return replay_run

        def replay_pd(models, calibration):
            between = {role: fit_between_stalls(models[role], [x for r in calibration
                                                               for x in timed_steps(role_steps(r, role))])
                       for role in ("prefill", "decode")}
            return replay_roles(models, between, replay_run_stalls)

        def replay_pd_waits(models, calibration):
            on_core_models = {role: fit_on_core(models[role], [role_steps(r, role) for r in calibration])
                              for role in ("prefill", "decode")}
            if None in on_core_models.values():
                return None
            return replay_roles(models, on_core_models, replay_run_waits)

        def pd_spec(models, shared_cores=False):
            configs = {role: dataclasses.replace(config, num_kv_blocks=blocks[role]) for role in blocks}

            def instance(role):
                if shared_cores:
                    model, slowdown = models[f"{role} shared"]
                    return InstanceSpec(role, model, configs[role], sharing_slowdown=slowdown)
                return InstanceSpec(role, models[role], configs[role])

            # Pushed, as the engine's kv_transfer="layerwise" does: decode blocks reserved before the prefill,
            # K/V sent from its end (the link is fitted to the part of each transfer the decode side waited
            # for: sent whole) while the first token goes to the client and the request to the decode worker.
            return ClusterSpec.disaggregated_cluster(
                instance("prefill"), instance("decode"), kv_per_token, models["link"], layerwise=False,
                num_layers=layers, push=engines["kv_transfer"] != "pull",
            ).with_control_latency(*models["control"])  # (the front end and the workers are processes apart)

        settings = {"blocks": blocks, "kv_transfer": engines["kv_transfer"],
                    "instance": dataclasses.asdict(config), "kv_bytes_per_token": kv_per_token, "num_layers": layers}
        real = real_side(pd, "1P1D (DisaggregatedLLM)", "1p1d", settings)
        report["1p1d"].update(judge(real, pd_spec, fit_pd, rescale_pd, args.num_requests, slo,
                                    variants={"shared_cores": lambda m, runs: pd_spec(m, shared_cores=True),
                                              "stalls_drawn": lambda m, runs: pd_spec({**m, **{
                                                  role: drawn_stalls(m[role], runs, lambda r, role=role:
                                                                     role_steps(r, role), seed)
                                                  for seed, role in enumerate(("prefill", "decode"))}})},
                                    replays={"stalls": replay_pd, "waits": replay_pd_waits},
                                    scale=lambda models, factor: scaled_pd(
                                        models, dict.fromkeys(("prefill", "decode"), factor))))
        report["1p1d"]["engine"] = repr(pd) if earlier is None else earlier["1p1d"]["engine"]
    runs = {label: report[label].pop("runs") for label in ("colocated", "1p1d")}
    if args.runs_out:
        Path(args.runs_out).write_bytes(gzip.compress(json.dumps(runs).encode()))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
