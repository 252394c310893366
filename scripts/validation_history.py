"""Several runs of ``scripts/validate_simulator.py`` side by side: how far one run's verdict can be trusted.

On a shared machine one validation run is one sample: its noise floor, its goodputs and which loads come out
within the targets move from run to run. This script boils each report down to those figures and writes them
together (``assets/sim/cpu_validation_history.json`` and, for the runs simulated also at each run's own speed,
``assets/sim/cpu_validation_at_speed.json``: the tables chapter 05b prints):

    python scripts/validation_history.py --out assets/sim/cpu_validation_history.json \\
        first.json second.json=15:30 ...

Give it reports simulated with the same version of the simulator (``validate_simulator.py --from-runs`` makes
one from an older run's stored real runs). A run is named by the time it started, kept in reports since
2026-12-06's evening; ``REPORT=LABEL`` names one from before.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minipd.sim.validate import TARGETS, within_targets

ENGINES = ("colocated", "1p1d")


def summary(report: dict, label: str) -> dict:
    """One run's figures: step-model error beside the noise floor, the goodputs, and per load which targets hold."""
    models = {"colocated": report["colocated"]["step_model"],
              "prefill": report["1p1d"]["step_model"]["prefill"], "decode": report["1p1d"]["step_model"]["decode"]}
    out = {"label": label, "machine": report["machine"], "date": report["date"],
           "simulated_again": report.get("simulated_again"), "simulator": report.get("simulator"),
           "step_model": {name: {"mape": m["mape"], "noise_floor": m["noise_floor"],
                                 **{k: m[k] for k in ("between_stalls", "on_core") if m.get(k) is not None}}
                          for name, m in models.items()}}
    for engine in ENGINES:
        entry = report[engine]
        goodput = entry["goodput"]
        out[engine] = {
            "capacity": entry["capacity"],
            "goodput": {k: goodput[k] for k in ("real", "repeat", "sim", "sim_speed_corrected", "real_tried",
                                                "sim_stalls_replayed", "sim_waits_replayed", "sim_shared_cores",
                                                "sim_stalls_drawn") if k in goodput},
            "loads": {str(row["fraction"]): _load(row) for row in entry["rows"]},
        }
    return out


def _verdict(table: dict, **also) -> dict:
    """Whether a compared table (a row, or a second simulation kept in it) is within every target, what else is
    kept beside (``also``), and its errors."""
    return {"within_targets": within_targets(table), **also, "errors": {k: table[k]["error"] for k in TARGETS}}


def _load(row: dict) -> dict:
    """One load's verdict and errors; the real repeat's errors against the first real run (how far the machine
    alone moves them); and, in reports that have them, the same at the speed the machine ran the real run, and
    with each real run's own stalls replayed (against that run), with its measured waits for a core replayed, how
    much a 5% faster or slower machine moves each simulated figure, the share of step time spent waiting for a
    core, and the simulation against the median of every real run of the row (``pooled``)."""
    load = {**_verdict(row), "repeat_errors": {k: row[k]["repeat_error"] for k in TARGETS}}
    # (Steps per role: real, repeat, simulated; a machine 5% faster/slower; the step time spent waiting for a core.)
    for key in ("steps", "sensitivity", "cpu_wait"):
        if key in row:
            load[key] = row[key]
    if "speed_corrected" in row:
        load["at_speed"] = _verdict(row["speed_corrected"], factors=row["speed_corrected"]["factors"])
    # (1P1D: the variant whose workers slow each other down on the shared cores; stalls drawn at the calibration
    # runs' rate.)
    for key in ("shared_cores", "stalls_drawn"):
        if key in row:
            load[key] = _verdict(row[key])
    # Against the median of every real run of the row (and each real run against the others' median).
    if "pooled" in row:
        pooled = row["pooled"]
        load["pooled"] = {k: pooled[k] for k in ("runs", "real", "real_median", "sim", "errors", "within_targets",
                                                  "real_errors", "real_within")}
        load["pooled"]["at_speed"] = {k: pooled["at_speed"][k] for k in ("factors", "errors", "within_targets")}
    # Each real run with its own stalls put back; with its measured waits for a core put back.
    for key in ("stalls_replayed", "repeat_stalls_replayed", "waits_replayed", "repeat_waits_replayed"):
        if key in row:
            load[key] = _verdict(row[key], found=row[key]["found"])
    return load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("reports", nargs="+", metavar="REPORT[=LABEL]")
    args = parser.parse_args(argv)
    runs = []
    for item in args.reports:
        path, _, label = item.rpartition("=") if "=" in item else (item, "", "")
        report = json.loads(Path(path).read_text())
        label = label or report.get("started") or ""
        if not label:
            parser.error(f"{path}: the report does not say when its run started: give it as {path}=LABEL")
        missing = [k for k in ENGINES if k not in report]
        if missing:
            parser.error(f"{path}: not a validate_simulator.py report (no {', '.join(missing)})")
        runs.append(summary(report, label))
    machines = {run["machine"] for run in runs}
    Path(args.out).write_text(json.dumps({"targets": TARGETS, "machines": sorted(machines), "runs": runs}, indent=1)
                              + "\n")
    print(f"wrote {args.out}: {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
