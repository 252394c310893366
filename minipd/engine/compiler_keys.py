"""Warm starts of the compiled decode step: the source hashes the compiler recomputes in every process, kept on disk.

Inductor keys its on-disk caches by a hash of torch's whole Python source (``torch_key``: ~2,300 files read
and hashed) and, where triton is installed, of triton's (``triton_key``, even on a CPU). Neither changes
until the install does, yet each process pays for both before its first program loads from the cache:
0.6–1.6 s of a 5 s warm start on the 2-core EPYC (measured with ``torch._dynamo.utils.compile_times``).

:func:`prime_compiler_keys` keeps them in ``compiler_keys.json`` beside the measured choices
(:func:`minipd.kernels.measured.choices_file`), each under a *fingerprint* of its install: the path, size
and modification time of every file of the package (a stat of each, ~0.06 s for torch), so an upgraded or
edited install is hashed afresh. A stored key is handed to inductor with ``set()``, the hook its own compile
workers receive the parent's keys through. Anything unexpected (another torch without that hook, an
unreadable folder) leaves inductor to compute its keys as usual.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from minipd.kernels.measured import choices_file, read_json, write_json

logger = logging.getLogger("minipd")

_lock = threading.Lock()
_primed = False


def keys_file() -> Path:
    """Where the keys are kept: ``compiler_keys.json`` in minipd's cache folder."""
    return choices_file().with_name("compiler_keys.json")


def install_fingerprint(root: str) -> str:
    """A hash of every file's path, size and modification time under ``root``: changes when any file does."""
    digest = hashlib.sha256(root.encode())
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _encode(value: bytes | str | None) -> dict[str, Any]:
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    return {"str": value}


def _decode(stored: dict[str, Any]) -> bytes | str | None:
    return base64.b64decode(stored["bytes"]) if "bytes" in stored else stored.get("str")


def _package_roots() -> dict[str, str]:
    """Each key's function name in ``torch._inductor.codecache`` and the folder its value hashes."""
    import importlib.util

    import torch

    roots = {"torch_key": os.path.dirname(torch.__file__)}
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        roots["triton_key"] = os.path.dirname(spec.origin)
    return roots


def prime_compiler_keys() -> dict[str, str]:
    """Hand inductor its source hashes from the on-disk store (computing and storing the missing ones); once
    per process. Returns what happened to each key: ``"stored"`` (read from disk), ``"computed"`` (and now
    stored), ``"set already"`` or why it was left to inductor."""
    global _primed
    with _lock:
        if _primed:
            return {}
        _primed = True
        try:
            from torch._inductor import codecache
        except ImportError as err:
            return {"all": f"left to inductor ({err})"}
        stored, outcome, changed = read_json(keys_file()), {}, False
        for name, root in _package_roots().items():
            function = getattr(codecache, name, None)
            if function is None or not hasattr(function, "set"):
                outcome[name] = "left to inductor (no set() hook in this torch)"
                continue
            fingerprint = install_fingerprint(root)
            entry = stored.get(name, {}).get(root)
            try:
                if isinstance(entry, dict) and entry.get("fingerprint") == fingerprint:
                    function.set(_decode(entry["value"]))
                    outcome[name] = "stored"
                else:
                    value = function()  # inductor's own computation, cached in this process by it
                    stored.setdefault(name, {})[root] = {"fingerprint": fingerprint, "value": _encode(value)}
                    outcome[name], changed = "computed", True
            except RuntimeError:  # set already in this process (inductor computed it before minipd asked)
                outcome[name] = "set already"
            except Exception as err:  # an odd entry or install: inductor computes the key itself
                outcome[name] = f"left to inductor ({type(err).__name__}: {err})"
        if changed:
            try:
                write_json(keys_file(), stored)
            except OSError as err:
                logger.info("compile_decode: could not keep the compiler's keys in %s (%s)", keys_file(), err)
        return outcome


__all__ = ["install_fingerprint", "keys_file", "prime_compiler_keys"]
