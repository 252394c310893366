"""Warm starts without tracing: each compiled decode program kept whole on disk, under a key of what built it.

Inductor's own caches spare a second start the *compiling* of a program, not the tracing: Dynamo still runs
the model's Python once per program to find the graph it then looks up (1.3–1.9 s of a ~5 s warm start of
tiny-py on the 2-core EPYC, plus ~1.5 s importing Dynamo's tracer). Torch's AOT precompile
(``torch.compile(...).aot_compile``) keeps the traced program instead: the graph's compiled code, the bytecode
that calls it and the signature, loaded back in a fraction of a second with nothing traced.

A loaded program skips Dynamo's guards (they would check the inputs' shapes and the model's attributes on
every call; AOT programs keep no guard that refers to live objects): the *key* stands in for them. It hashes
everything a trace of the step depends on: torch, Python, the CPU and its ISA features, the thread count,
minipd's own source (every file of the package: a changed model or kernel is a new key), the model's module
tree (types, every plain attribute, parameter and buffer names, shapes and dtypes — not their values, which a
program reads where they lie), the step's own settings, the shapes, strides and dtypes of every input, and the
compiler options. A program that is loaded is also run once beside the eager step on a probe input before
it is used; if they differ it is discarded and traced again (overwriting the file).

The files are pickles (torch's format for these programs): they are only read from minipd's own cache folder
(:func:`programs_dir`, under ``$MINIPD_CACHE_DIR`` or ``~/.cache/minipd``), only if the current user owns them
and nobody else can write them or their folder, never from a socket. ``MINIPD_PROGRAM_CACHE=0`` turns the
cache off (programs are then traced in every process, through inductor's caches as before). The folder is kept
under ``MINIPD_PROGRAM_CACHE_MB`` (2,048 by default) by removing the least recently used programs, and nothing
else in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import platform
import re
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from minipd.kernels.isa import flags_digest, isa_limits
from minipd.kernels.measured import choices_file, cpu_description

logger = logging.getLogger("minipd")

#: Set to ``0`` to keep no program on disk (and load none).
ENV_SWITCH = "MINIPD_PROGRAM_CACHE"
#: Megabytes the programs may take on disk (see :func:`limit_bytes`).
LIMIT_ENV = "MINIPD_PROGRAM_CACHE_MB"
#: A program's file name: its key (a SHA-256, hex) and the suffix; :func:`trim` touches nothing else.
_PROGRAM_NAME = re.compile(r"[0-9a-f]{64}\.program")
#: Bumped when what a file holds, or what the key covers, changes.
FORMAT_VERSION = 1
#: The attributes every ``nn.Module`` has for torch's own bookkeeping (parameters, hooks...): not the model's.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_HOOK_DICTS = tuple(name for name in _MODULE_INTERNALS if "hook" in name)


def enabled() -> bool:
    """Whether programs are kept on disk (``MINIPD_PROGRAM_CACHE`` unset or not ``0``)."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")


def programs_dir() -> Path:
    """Where programs are kept: ``decode_programs/`` in minipd's cache folder (beside the measured choices)."""
    return choices_file().with_name("decode_programs")


@functools.cache
def source_fingerprint() -> str:
    """A hash of every file of the installed minipd package (see :func:`folder_fingerprint`)."""
    return folder_fingerprint(Path(__file__).resolve().parent.parent)


def folder_fingerprint(root: Path) -> str:
    """A hash of every file's path and contents under ``root`` (contents, not times: two clones of one commit
    share their programs), compiled bytecode caches left out."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def describe(value: Any, depth: int = 3) -> Any:
    """What of ``value`` a trace can depend on, as plain JSON-able data: numbers, strings, dtypes, shapes of
    tensors (not their values), functions by name, containers and objects' attributes ``depth`` levels deep
    (an object's identity, such as its address, never: it changes from process to process)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.dtype | torch.device | enum.Enum):
        return str(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": [list(value.shape), list(value.stride()), str(value.dtype), value.device.type]}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if depth <= 0:
        return type(value).__qualname__
    if isinstance(value, list | tuple | set | frozenset):
        items = [describe(v, depth - 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, dict):
        return {str(k): describe(v, depth - 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if dataclasses.is_dataclass(value):
        fields = {f.name: describe(getattr(value, f.name), depth - 1) for f in dataclasses.fields(value)}
        return {"type": type(value).__qualname__, **fields}
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return {"type": type(value).__qualname__,
                **{k: describe(v, depth - 1) for k, v in sorted(attributes.items())}}
    return type(value).__qualname__


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """A module tree as a trace sees it: each module's type and plain attributes, how many hooks it has, and
    every parameter's and buffer's name, shape, stride and dtype."""
    modules = {}
    for name, module in model.named_modules():
        own = {k: describe(v) for k, v in sorted(vars(module).items()) if k not in _MODULE_INTERNALS}
        hooks = sum(len(getattr(module, h)) for h in _HOOK_DICTS if isinstance(getattr(module, h, None), dict))
        modules[name] = {"type": describe(type(module)), "training": module.training, "hooks": hooks, **own}
    tensors = {name: describe(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    return {"modules": modules, "tensors": tensors}


def program_key(parts: dict[str, Any]) -> str:
    """The key of a program built from ``parts`` (what the caller traced it from) on this machine and install."""
    cpu = cpu_description()
    # (the compiler's generated code follows torch's instruction set, which ATEN_CPU_CAPABILITY may limit)
    everything = {"format": FORMAT_VERSION, "torch": torch.__version__, "python": sys.version,
                  "machine": platform.machine(), "cpu": cpu["cpu"], "cpu_id": cpu.get("id"),
                  "features": cpu["features"], "flags": flags_digest(),
                  "torch_isa": torch.backends.cpu.get_cpu_capability(), "isa_limits": isa_limits(),
                  "threads": torch.get_num_threads(), "minipd": source_fingerprint(), **parts}
    text = json.dumps(everything, sort_keys=True, default=lambda v: describe(v))
    return hashlib.sha256(text.encode()).hexdigest()


_naming = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_original_unique_id: Callable[..., str] | None = None


def _unique_id(prefix: str, with_uuid: bool = False) -> str:
    stable = getattr(_naming, "name", None)
    if stable is not None and prefix == "__compiled_fn" and with_uuid:
        return stable
    return _original_unique_id(prefix, with_uuid)  # type: ignore[misc]


_names_given: dict[str, int] = {}


def _graph_name(key: str) -> str:
    """The name the graph of the program under ``key`` is given: the same in every process for its first
    precompile there (what AOTAutograd's cache needs, see :func:`stable_graph_name`), numbered after that
    (a name can be defined only once in a process)."""
    with _patch_lock:
        count = _names_given.get(key, 0)
        _names_given[key] = count + 1
    return f"__compiled_fn_minipd_{key[:32]}_{count}"


@contextlib.contextmanager
def stable_graph_name(key: str) -> Iterator[None]:
    """While this thread precompiles the program under ``key``, the graph Dynamo hands the compiler gets a name
    made from the key rather than a fresh random one.

    The name is part of the key of AOTAutograd's cache, the only compiler cache a precompile consults (inductor's
    FX-graph cache is skipped for bundled programs): with a random name no precompile ever found the work of an
    earlier process, so a program missing from :func:`programs_dir` took ~5 s to build where a traced one found
    in inductor's cache takes ~2. Other threads, and torch versions without this hook, keep their names."""
    global _patch_users, _original_unique_id
    from torch._dynamo import output_graph

    with _patch_lock:
        if _patch_users == 0:
            _original_unique_id = getattr(output_graph, "unique_id", None)
            if _original_unique_id is not None:
                output_graph.unique_id = _unique_id
        _patch_users += 1
    _naming.name = _graph_name(key)
    try:
        yield
    finally:
        _naming.name = None
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0 and _original_unique_id is not None:
                output_graph.unique_id = _original_unique_id


def _private(path: Path) -> bool:
    """Whether ``path`` is this user's own and nobody else may write it."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def path_for(key: str) -> Path:
    """The file of the program under ``key``."""
    return programs_dir() / f"{key}.program"


def load(key: str, external: dict[str, Any]) -> Callable[..., Any] | None:
    """The program stored under ``key``, or None (none stored, not safe to read, or it does not load here).
    ``external``: the live objects the program was saved referring to (see :func:`save`)."""
    path = path_for(key)
    if not path.is_file():
        return None
    if not (_private(path) and _private(path.parent)):
        logger.warning("compile_decode: not loading %s: it or its folder can be written by another user", path)
        return None
    try:
        with path.open("rb") as f:
            program = torch.compiler.load_compiled_function(f, external_data=external)
    except Exception as err:  # another torch's file, a truncated one...: trace anew
        logger.info("compile_decode: stored program %s did not load (%s: %s)", path.name, type(err).__name__, err)
        return None
    program.disable_guard_check()  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: the last to go when the folder is trimmed
    return program


def save(program: Any, key: str, external: dict[str, Any]) -> Path | None:
    """Keep ``program`` (torch's AOT-compiled function) under ``key``; the live objects it refers to (the model,
    the engine's step) are named in ``external`` and not written. Returns the file, or None if it could not be
    written (the program still runs; the next process traces it again)."""
    folder = programs_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        program.save_compiled_function(str(path_for(key)), external_data=external)  # atomic: a temp file, renamed
    except Exception as err:
        logger.info("compile_decode: program not kept on disk (%s: %s)", type(err).__name__, err)
        return None
    trim(limit_bytes())
    return path_for(key)


def limit_bytes() -> int:
    """How much the programs may take on disk: ``MINIPD_PROGRAM_CACHE_MB`` megabytes, 2,048 by default (a
    tiny-py program is ~0.6 MB; every change of minipd's source or of an engine's shape adds a new set)."""
    try:
        return int(float(os.environ.get(LIMIT_ENV, "2048")) * 2**20)
    except ValueError:
        return 2048 * 2**20


def trim(limit: int) -> list[Path]:
    """Remove the least recently used programs until the folder holds at most ``limit`` bytes of them; returns
    what was removed. Only files named as this module names programs are counted or removed: nothing else in
    the folder is touched."""
    entries = []
    for path in programs_dir().glob("*.program"):
        if _PROGRAM_NAME.fullmatch(path.name):
            with contextlib.suppress(OSError):
                info = path.stat()
                entries.append((info.st_mtime_ns, info.st_size, path))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
            total -= size
    return removed


__all__ = ["ENV_SWITCH", "LIMIT_ENV", "describe", "describe_model", "enabled", "folder_fingerprint",
           "limit_bytes", "load", "path_for", "program_key", "programs_dir", "save", "source_fingerprint",
           "stable_graph_name", "trim"]
