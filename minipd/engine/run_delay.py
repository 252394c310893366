"""How long the calling thread has waited for a core: Linux's run delay (``/proc/thread-self/schedstat``).

A step's wall time is its work plus the time its thread was ready to run but another process had the core. On a
machine of two cores shared by a front end and two workers the second part is not small, and it grows with the
load; a step-time model that is fitted to wall times learns it as if it were work. Reading the run delay before
and after a step separates the two (:attr:`minipd.engine.stats.StepStats.cpu_wait`).

The file gives three numbers: nanoseconds on a core, nanoseconds waiting on a run queue, and time slices. It is
read with ``pread`` on a descriptor kept open per thread (under a microsecond a read; opening it each time costs
five). Where the file does not exist (not Linux, or a kernel without scheduler statistics) the answer is None.
"""

from __future__ import annotations

import os
import threading

_PATH = "/proc/thread-self/schedstat"


class _OpenFile:
    """One thread's descriptor of the file, closed when the thread ends (its thread-local values go then)."""

    def __init__(self) -> None:
        # (/proc/thread-self names the thread that opens it; the descriptor stays that thread's file.)
        self.fd = os.open(_PATH, os.O_RDONLY)

    def __del__(self) -> None:
        if hasattr(self, "fd"):  # (not if the open failed)
            os.close(self.fd)


_local = threading.local()
_missing = False


def thread_run_delay() -> float | None:
    """Seconds the calling thread has spent ready to run but waiting for a core since it started; None where
    the operating system does not say."""
    global _missing
    if _missing:
        return None
    try:
        opened = getattr(_local, "file", None)
        if opened is None:
            opened = _local.file = _OpenFile()
        return int(os.pread(opened.fd, 64, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        _missing = True  # (the same for every thread: no point asking again)
        return None


__all__ = ["thread_run_delay"]
