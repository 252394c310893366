"""Choices made by measuring this machine, not by guessing from its vendor: which linear path is faster,
and up to which step size one thread beats all of them.

Whether oneDNN's packed linears beat torch's ``F.linear`` (MKL) depends on the CPU: on an AMD EPYC with
AVX-512 oneDNN took about half MKL's time from 4 rows up, while on an Intel Xeon with AMX MKL was as fast
and the packed path ran a mixed workload at 0.88x. So ``python -m minipd build-kernels`` times both on
this machine, on real engine steps (:func:`measure_linear_backend`), and keeps the winner in a small JSON
file under the user's cache folder, keyed by the CPU, its instruction-set features, torch's version and
the thread count; ``linear_backend="auto"`` reads it (:func:`measured_choice`) and falls back to
oneDNN-if-available when nothing was measured for this machine. Likewise for the step size up to which
one thread beats all (:func:`measure_small_step_tokens`, read by ``cpu_threads="auto"``).
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

#: oneDNN is chosen only when it takes less than this share of torch's time (noise must not flip it).
MARGIN = 0.95
#: One thread counts as no slower than all up to this ratio of their step times (timing noise is a few percent).
TIE = 1.03
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


def _step_times(core: Any, batch: int, prompt_len: int, rounds_tag: str) -> tuple[float, float]:
    """One run of ``batch`` requests of ``prompt_len`` tokens through ``core``: the first (prefill) step's time
    and the median of its decode steps."""
    from minipd.engine.request import Request
    from minipd.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 250 + 3 for j in range(prompt_len)]
        core.add_request(Request(f"{rounds_tag}{i}", ids, prompt_len, params, 0, frozenset(), 1024, 0.0))
    steps = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    return steps[0], statistics.median(steps[2:])


def _measure_cores(options: dict[str, dict[str, Any]], cases: tuple[tuple[int, int], ...], rounds: int,
                   model: str) -> dict[str, dict[tuple[int, int], float]]:
    """For each engine configuration in ``options``, each (batch, prompt length) case: the median over ``rounds``
    (interleaved across configurations) of its prefill step plus ten times its decode step."""
    from minipd.engine.config import EngineConfig
    from minipd.engine.factory import build_core

    before = torch.get_num_threads()
    built = {name: build_core(model, engine_config=EngineConfig(num_kv_blocks=512, enable_prefix_caching=False,
                                                                **opts)) for name, opts in options.items()}
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {c: [] for c in cases} for name in built}
    try:
        for r in range(rounds):
            for case in cases:
                for name, b in built.items():  # interleaved: a busy moment hurts every configuration
                    prefill, decode = _step_times(b.core, *case, f"r{r}-")
                    times[name][case].append(prefill + 10 * decode)
    finally:
        for b in built.values():
            b.close()
        torch.set_num_threads(before)
    return {name: {c: statistics.median(v) for c, v in per.items()} for name, per in times.items()}


#: (batch, prompt length) cases the linear paths are timed on: one stream, decode batches, a long prefill.
LINEAR_CASES = ((1, 32), (8, 32), (32, 64), (1, 512))


def measure_linear_backend(rounds: int = 3, model: str = "tiny-py",
                           cases: tuple[tuple[int, int], ...] = LINEAR_CASES) -> dict[str, Any]:
    """Time ``model``'s engine steps with ``F.linear`` and with oneDNN's packed linears (fp32, this process's
    threads) on (batch, prompt length) ``cases``: one stream, small and large decode batches, a long prefill.
    Each case counts its prefill step and ten decode steps; the medians are summed. Returns the record:
    ``choice`` ("onednn" when it takes under :data:`MARGIN` of torch's time, else "torch"), the ratio, and the
    per-case ratios. (Measured on real steps: a bench of the linears alone chose wrong on this project's CPU.)"""
    from minipd.kernels.cpu_linear import onednn_available

    if not onednn_available():
        return {"choice": "torch", "why": "this torch build has no oneDNN linear", "ratio": None}
    threads = torch.get_num_threads()
    t = _measure_cores({"torch": {"linear_backend": "torch", "cpu_threads": threads},
                        "onednn": {"linear_backend": "onednn", "cpu_threads": threads}}, cases, rounds, model)
    ratio = sum(t["onednn"].values()) / sum(t["torch"].values())
    return {"choice": "onednn" if ratio < MARGIN else "torch", "ratio": round(ratio, 3),
            "cases": {f"{b}x{n}": round(t["onednn"][(b, n)] / t["torch"][(b, n)], 3) for b, n in cases},
            **cpu_description()}


def measure_small_step_tokens(threads: int | None = None, rounds: int = 3, model: str = "tiny-py",
                              sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> dict[str, Any]:
    """Up to how many tokens a step is faster on one thread than on ``threads`` (torch's count by default),
    measured on real steps of ``model`` (a proxy of linears alone misleads: a small step is dozens of small
    ops, each paying the threads' fork and join): batches of each size on one thread and on all,
    interleaved. The choice is the largest batch up to which one thread was never slower by more than
    :data:`TIE` (0: it always was)."""
    threads = threads or torch.get_num_threads()
    cases = tuple((size, 4) for size in sizes)
    t = _measure_cores({str(count): {"cpu_threads": count, "linear_backend": "torch"} for count in {1, threads}},
                       cases, rounds, model)
    ratios = {size: round(t["1"][(size, 4)] / t[str(threads)][(size, 4)], 3) for size in sizes}
    choice = 0
    for size, ratio in ratios.items():  # (in increasing order)
        if ratio > TIE:
            break
        choice = size
    return {"choice": choice, "threads": threads, "one_thread_vs_all": ratios, **cpu_description()}


__all__ = ["LINEAR_CASES", "choices_file", "cpu_description", "machine_key", "measure_linear_backend",
           "measure_small_step_tokens", "measured_choice", "save_choice"]
