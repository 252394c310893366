"""Choices made by measuring this machine, not by guessing from its vendor, kept per machine: which linear
path is faster, and up to which step size one thread beats all of them.

Which linear path is fastest depends on the CPU: on an AMD EPYC with AVX-512 oneDNN took about half MKL's
time from 4 rows up, while on an Intel Xeon with AMX MKL was as fast and the packed path ran a mixed workload
at 0.88x; on an AVX2-only EPYC minipd's own panel kernel beat both. So ``python -m minipd build-kernels``
times every path there is (torch's ``F.linear``, oneDNN, the C++ kernel) on this machine, on real engine
steps (:mod:`minipd.engine.measure`), and keeps the winner in a small JSON file under the user's cache
folder, keyed by the CPU (its name, family and model, and every feature flag it reports), torch's version
and the thread count;
``linear_backend="auto"`` reads it (:func:`measured_choice`) and, when nothing was measured for this machine
(or the C++ kernel was not among what was), takes the C++ kernel if built, else oneDNN if available. Likewise
for the step size up to which one thread beats all (read by ``cpu_threads="auto"``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minipd.kernels.isa import cpu_flags, cpu_identity, cpu_model, flags_digest, isa_limits, kernel_isa, usable_features

#: A packed path is chosen over torch's only when it takes less than this share of its time (noise must not flip it).
MARGIN = 0.95
#: One thread counts as no slower than all up to this ratio of their step times (timing noise is a few percent).
TIE = 1.03
#: CPU features that change which kernels are fast.
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_description() -> dict[str, Any]:
    """The CPU's model name, its generation (``"id"``: x86's family and model, where Linux reports them) and the
    instruction-set features that matter here (Linux's /proc/cpuinfo), less those the kernels are not built to use
    (``MINIPD_CPU_ISA``, :mod:`minipd.kernels.isa`: its value is then under ``"isa"``)."""
    isa = kernel_isa()
    usable = usable_features(cpu_flags(), isa)
    features = [f for f in FEATURES if f in usable]
    identity = cpu_identity()
    return {"cpu": cpu_model(), **({"id": identity} if identity else {}), "features": features,
            **({"isa": isa} if isa != "native" else {})}


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache as Linux reports it (``/sys/devices/system/cpu/cpu0/cache``), or None
    where it does not."""
    sizes = []
    for folder in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            kind, text = (folder / "type").read_text().strip(), (folder / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if kind != "Instruction" and digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def machine_key(threads: int | None = None) -> str:
    """What a measured choice is valid for: the CPU (name, family and model, the features that matter and a hash
    of all it reports: one name may cover two generations whose fastest paths differ), torch's version and the
    thread count, and the instruction-set limits the process runs under, if any
    (:func:`~minipd.kernels.isa.isa_limits`: oneDNN or MKL held to AVX2 may well change which linear path wins)."""
    cpu = cpu_description()
    threads = threads or torch.get_num_threads()
    key = (f"{cpu['cpu']}|{cpu.get('id', '')}|{','.join(cpu['features'])}|flags {flags_digest()}"
           f"|torch {torch.__version__}|{threads} threads")
    limits = isa_limits()
    return key + ("|" + ",".join(f"{k}={v}" for k, v in sorted(limits.items())) if limits else "")


def choices_file() -> Path:
    """Where measured choices are kept: ``$MINIPD_CACHE_DIR/measured.json``, by default
    ``~/.cache/minipd/measured.json`` (under ``$XDG_CACHE_HOME`` when set)."""
    folder = os.environ.get("MINIPD_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "minipd")
    return Path(folder) / "measured.json"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object kept in minipd's cache folder, or ``{}`` when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _read() -> dict[str, dict[str, Any]]:
    return read_json(choices_file())


def measured_record(name: str, threads: int | None = None) -> dict[str, Any] | None:
    """The whole record measured for ``name`` on this machine (same CPU, features, torch and threads), or None."""
    entry = _read().get(machine_key(threads))
    record = entry.get(name) if isinstance(entry, dict) else None
    return record if isinstance(record, dict) else None


def measured_choice(name: str, threads: int | None = None) -> Any:
    """The value measured for ``name`` on this machine (same CPU, features, torch and threads), or None."""
    record = measured_record(name, threads)
    return None if record is None else record.get("choice")


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn``, after one untimed call (a warm-up: caches, oneDNN's
    primitive cache)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def save_choice(name: str, record: dict[str, Any], threads: int | None = None) -> Path:
    """Keep ``record`` (with its ``choice``) for ``name`` on this machine; returns the file (written atomically)."""
    data = _read()
    data.setdefault(machine_key(threads), {})[name] = record
    path = choices_file()
    write_json(path, data)
    return path


__all__ = ["FEATURES", "MARGIN", "TIE", "best_seconds", "choices_file", "cpu_description", "last_level_cache_bytes",
           "machine_key", "measured_choice", "measured_record", "read_json", "save_choice", "write_json"]
