"""The run delay a thread reads from Linux: the time it was ready to run while other processes had the cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from minipd.engine.run_delay import thread_run_delay

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                                reason="no scheduler statistics (/proc/thread-self/schedstat): not Linux")


def spin(seconds: float) -> tuple[float, float, float]:
    """Spin for ``seconds`` of wall time; (wall, on a core, waiting for a core) over it."""
    waited, on_core, start = thread_run_delay(), time.thread_time(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass
    return time.perf_counter() - start, time.thread_time() - on_core, thread_run_delay() - waited


def test_a_spinning_thread_is_on_a_core_or_waiting_for_one_and_each_thread_counts_its_own():
    import threading

    # As many busy processes as cores, plus this thread: it gets a core about cores/(cores+1) of the time. Every
    # second it does not get is run delay, so time on a core and run delay add up to the wall time.
    loop = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"  # (bounded even if orphaned)
    busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)  # (they are running)
        wall, on_core, waited = spin(1.0)
        seen: list = []
        other = threading.Thread(target=lambda: seen.append(thread_run_delay()))
        other.start()
        other.join(timeout=10)
    finally:
        for process in busy:
            process.kill()
            process.wait(timeout=10)
    assert waited > 0.1 * wall, (wall, on_core, waited)
    # (Time the host took the whole machine away is in neither: a few percent at most.)
    assert on_core + waited == pytest.approx(wall, rel=0.15), (wall, on_core, waited)
    # A new thread counts from its own start, not from this thread's total.
    assert isinstance(seen[0], float) and 0.0 <= seen[0] < thread_run_delay() / 2, (seen, waited)

