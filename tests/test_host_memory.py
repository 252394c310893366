"""Freed host memory kept in the process (minipd.engine.host_memory): a CPU engine's steps stop page-faulting their
activations in again, and the setting can be turned off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from minipd.engine.host_memory import KEEP_FREED_MEMORY_ENV

# Rounds of three 24 MB blocks from malloc (what torch's CPU allocator calls), written and freed. By default glibc
# serves them from its heap once the first frees have raised its mmap threshold to their size, and gives the 72 MB
# back at every free (more than twice that threshold lies free at the top of the heap): every round faults all its
# pages in again. (Torch's own aligned allocations settle in a pattern that depends on where they fall.)
ROUNDS = """
import ctypes, json, resource, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "keep":
    from minipd.engine.host_memory import keep_freed_memory
    print(keep_freed_memory(), file=sys.stderr)
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(24 << 20) for _ in range(3)]
    for block in blocks:
        libc.memset(block, 1, 24 << 20)
    for block in blocks:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _faults_per_round(mode: str, env: dict[str, str] | None = None) -> list[int]:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's (mallopt); other C libraries are left alone")
def test_kept_memory_is_not_faulted_in_again_and_the_default_is():
    default = _faults_per_round("default")
    kept = _faults_per_round("keep")
    # 72 MB is 18,432 pages of 4 KB: the default faults most of them in every round, to the last.
    assert min(default[-3:]) > 10_000, default
    # Kept, the heap holds them after the first round, and nothing more is faulted in.
    assert max(kept[1:]) < 500, kept
    # Turned off, glibc's defaults stay.
    assert min(_faults_per_round("keep", {KEEP_FREED_MEMORY_ENV: "0"})[-3:]) > 10_000


def test_a_cpu_engine_says_how_freed_memory_is_treated():
    from minipd import LLM

    llm = LLM("tiny-py", num_kv_blocks=16, max_num_seqs=2)
    said = llm.describe()["host_memory"]
    if GLIBC and os.environ.get(KEEP_FREED_MEMORY_ENV, "1") != "0":
        assert said.startswith("glibc keeps freed memory: blocks under 32 MiB from its heap")
    else:
        assert said.startswith("the C library's defaults")
