"""Choices made by measuring this machine, not by guessing from its vendor: which linear path is faster,
and up to which step size one thread beats all of them.

Whether oneDNN's packed linears beat torch's ``F.linear`` (MKL) depends on the CPU: on an AMD EPYC with
AVX-512 oneDNN took about half MKL's time from 4 rows up, while on an Intel Xeon with AMX MKL was as fast
and the packed path ran a mixed workload at 0.88x. So ``python -m minipd build-kernels`` times both on
this machine (:func:`measure_linear_backend`) and keeps the winner in a small JSON file under the user's
cache folder, keyed by the CPU, its instruction-set features, torch's version and the thread count;
``linear_backend="auto"`` reads it (:func:`measured_choice`) and falls back to oneDNN-if-available when
nothing was measured for this machine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Linear shapes timed (in, out): tiny-py's projections and a ~50M-parameter model's.
SHAPES = ((256, 256), (256, 768), (512, 1536), (1536, 512))
#: Rows per call, as steps have them: one decode, a small batch of decodes, a prefill chunk.
ROWS = (1, 8, 64, 256)
#: oneDNN is chosen only when it takes less than this share of torch's time (noise must not flip it).
MARGIN = 0.95
#: CPU features that change which kernels are fast.
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the instruction-set features that matter here (Linux's /proc/cpuinfo)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
            if name and flags:
                break
    except OSError:
        pass
    return {"cpu": name, "features": [f for f in FEATURES if f in flags]}


def machine_key(threads: int | None = None) -> str:
    """What a measured choice is valid for: the CPU, its features, torch's version and the thread count."""
    cpu = cpu_description()
    threads = threads or torch.get_num_threads()
    return f"{cpu['cpu']}|{','.join(cpu['features'])}|torch {torch.__version__}|{threads} threads"


def choices_file() -> Path:
    """Where measured choices are kept: ``$MINIPD_CACHE_DIR/measured.json``, by default
    ``~/.cache/minipd/measured.json`` (under ``$XDG_CACHE_HOME`` when set)."""
    folder = os.environ.get("MINIPD_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "minipd")
    return Path(folder) / "measured.json"


def _read() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(choices_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measured_choice(name: str, threads: int | None = None) -> Any:
    """The value measured for ``name`` on this machine (same CPU, features, torch and threads), or None."""
    entry = _read().get(machine_key(threads))
    return entry.get(name, {}).get("choice") if isinstance(entry, dict) and isinstance(entry.get(name), dict) \
        else None


def save_choice(name: str, record: dict[str, Any], threads: int | None = None) -> Path:
    """Keep ``record`` (with its ``choice``) for ``name`` on this machine; returns the file (written atomically)."""
    data = _read()
    data.setdefault(machine_key(threads), {})[name] = record
    path = choices_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def _time(fn: Any, x: torch.Tensor, repeats: int) -> float:
    fn(x)  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    return (time.perf_counter() - start) / repeats


@torch.inference_mode()
def measure_linear_backend(rounds: int = 5, budget_s: float = 0.02) -> dict[str, Any]:
    """Time ``F.linear`` against oneDNN's packed linear on :data:`SHAPES` x :data:`ROWS` (fp32, this
    process's threads), interleaved over ``rounds``; the median per case, summed. Returns the record:
    ``choice`` ("onednn" when it takes under :data:`MARGIN` of torch's time, else "torch"), the two totals,
    their ratio, and the per-case ratios."""
    from minipd.kernels.cpu_linear import PackedLinear, onednn_available

    if not onednn_available():
        return {"choice": "torch", "why": "this torch build has no oneDNN linear", "ratio": None}
    gen = torch.Generator().manual_seed(0)
    totals = {"torch": 0.0, "onednn": 0.0}
    cases = {}
    for n_in, n_out in SHAPES:
        linear = nn.Linear(n_in, n_out)
        packed = PackedLinear(linear)
        for rows in ROWS:
            x = torch.randn(rows, n_in, generator=gen)
            repeats = max(3, int(budget_s / max(_time(packed, x, 3), 1e-7)))
            times: dict[str, list[float]] = {"torch": [], "onednn": []}
            for _ in range(rounds):  # interleaved: a busy moment hurts both
                times["torch"].append(_time(linear, x, repeats))  # (nn.Linear is F.linear)
                times["onednn"].append(_time(packed, x, repeats))
            medians = {k: statistics.median(v) for k, v in times.items()}
            for k, v in medians.items():
                totals[k] += v
            cases[f"{n_in}x{n_out}@{rows}"] = round(medians["onednn"] / medians["torch"], 3)
    ratio = totals["onednn"] / totals["torch"]
    return {"choice": "onednn" if ratio < MARGIN else "torch", "ratio": round(ratio, 3),
            "torch_s": totals["torch"], "onednn_s": totals["onednn"], "cases": cases, **cpu_description()}


@torch.inference_mode()
def measure_small_step_tokens(threads: int | None = None, rounds: int = 5, budget_s: float = 0.01) -> dict[str, Any]:
    """Up to how many tokens a step is faster on one thread than on ``threads`` (torch's count by default):
    a chain of tiny-py-sized linears (the bulk of a small step) timed at 1, 2, 4 ... 64 rows on both counts,
    interleaved. The choice is the largest row count up to which one thread never lost (0: it always lost)."""
    threads = threads or torch.get_num_threads()
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    chain = nn.Sequential(*[nn.Linear(a, b) for a, b in ((256, 768), (768, 256))] * 3)
    cases: dict[int, float] = {}
    try:
        for rows in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(rows, 256, generator=gen)
            repeats = max(3, int(budget_s / max(_time(chain, x, 3), 1e-7)))
            times: dict[int, list[float]] = {1: [], threads: []}
            for _ in range(rounds):
                for count in times:
                    torch.set_num_threads(count)
                    times[count].append(_time(chain, x, repeats))
            cases[rows] = round(statistics.median(times[1]) / statistics.median(times[threads]), 3)
    finally:
        torch.set_num_threads(before)
    choice = 0
    for rows, ratio in cases.items():  # (in increasing order)
        if ratio > 1.0:
            break
        choice = rows
    return {"choice": choice, "threads": threads, "one_thread_vs_all": cases, **cpu_description()}


__all__ = ["choices_file", "cpu_description", "machine_key", "measure_linear_backend", "measure_small_step_tokens",
           "measured_choice", "save_choice"]
