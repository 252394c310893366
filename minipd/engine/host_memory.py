"""Keeping freed host memory in the process, so a CPU step does not page-fault its activations in again.

A CPU step allocates its activations afresh: a 1,162-token prefill of the ~50M model writes about 270 MB of
outputs from its linear layers alone. glibc's ``malloc`` serves blocks from 128 KB up with ``mmap`` until a
free raises that threshold, and gives the top of its heap back to the kernel (``trim``) once more than twice the
threshold lies free there; how often a step's blocks come back as fresh pages (each one faulted in and zeroed by
the kernel) depends on the order of the process's earlier allocations. On a 2-core Zen 5 the same engine's prefill
page-faulted 25,000-53,000 pages a run in some processes (0.28-0.31 s) and about 1,400 in others (0.25 s); with
the memory kept, none after the first run (0.24 s), with or without a pause between runs. vLLM's CPU guide and
PyTorch's tuning guide preload tcmalloc or jemalloc for this; :func:`keep_freed_memory` asks glibc itself, with
``mallopt``, to serve blocks below 32 MiB from its heap and to keep up to 1 GiB free there. What the process
keeps is memory it used before (its heap's high-water mark), not more.

It is process-wide and applied once, when the first CPU engine is built. ``MINIPD_KEEP_FREED_MEMORY=0`` leaves
the allocator as it is; other C libraries (macOS, musl) are left alone, and the engine's ``describe()`` says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

#: The environment variable that turns the setting off ("0").
KEEP_FREED_MEMORY_ENV = "MINIPD_KEEP_FREED_MEMORY"
#: Blocks below this come from the heap (glibc's largest allowed value on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap up to this much is kept.
TRIM_THRESHOLD = 1 << 30
# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_memory() -> str:
    """Ask glibc to keep freed memory for the next step (once per process); what was done, in words."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0":
        return f"the C library's defaults ({KEEP_FREED_MEMORY_ENV}=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the C library's defaults (not glibc: nothing to set)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "the C library's defaults (glibc refused mallopt)"
    return (f"glibc keeps freed memory: blocks under {MMAP_THRESHOLD >> 20} MiB from its heap, "
            f"up to {TRIM_THRESHOLD >> 30} GiB of it kept free")


__all__ = ["KEEP_FREED_MEMORY_ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]
