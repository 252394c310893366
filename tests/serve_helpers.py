"""A live server for tests: in this process (a thread of its own) or as ``python -m minipd serve``, always
bounded in time and stopped, even when the test fails; and every request state a front end is given, kept
for the checks (the async engine's tests use it too)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from minipd.async_llm import AsyncLLM
from minipd.serve.server import BackgroundServer

ROOT = Path(__file__).resolve().parent.parent


class LoopLagProbe:
    """How late an event loop wakes a 5 ms sleep, and how much of that lateness is the loop's own doing.

    On two shared cores, with an engine thread, worker processes and a client beside it, the OS alone can keep
    the loop's thread waiting for a core for a few time slices: lateness that says nothing about the code. Linux
    counts that wait per thread (``/proc/thread-self/schedstat``: time runnable but not running); the loop's own
    delay is the lateness less that wait. A long callback, too many callbacks in one turn, or a callback that
    blocks on a lock or a sleep all still count. (Where the file cannot be read, the whole lateness counts.) Run
    :meth:`run` as a task in the loop.
    """

    INTERVAL = 0.005

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.own: list[float] = []
        self.running = True

    @staticmethod
    def _waited_for_a_core() -> float | None:
        try:
            with open("/proc/thread-self/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.running:
            start, waited = loop.time(), self._waited_for_a_core()
            await asyncio.sleep(self.INTERVAL)
            late = max(0.0, loop.time() - start - self.INTERVAL)
            now = self._waited_for_a_core()
            self.lags.append(late)
            self.own.append(late if waited is None or now is None else max(0.0, late - (now - waited)))

    @staticmethod
    def p99(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[int(0.99 * (len(ordered) - 1))]

    def report(self) -> str:
        lags = sorted(self.lags)
        return (f"event-loop lag P50 {lags[len(lags) // 2] * 1000:.1f} ms, P99 {self.p99(lags) * 1000:.1f} ms, max "
                f"{lags[-1] * 1000:.1f} ms; less the waits for a core, P99 {self.p99(self.own) * 1000:.1f} ms")

    def check(self, bound: float = 0.020) -> None:
        """The loop never delayed itself past ``bound`` (P99), whatever else the machine ran meanwhile."""
        assert self.p99(self.own) <= bound, f"the event loop delayed itself: {self.report()}"


@contextlib.contextmanager
def serving(llm, name: str = "tiny-py", **options) -> Iterator[BackgroundServer]:
    """``llm`` behind the API on 127.0.0.1 (a free port); the engine thread and the server stop on the way out."""
    engine = AsyncLLM.from_llm(llm)
    server = BackgroundServer(engine, name, grace=1.0, **options)
    try:
        server.start(timeout=30)
        yield server
    finally:
        server.stop(timeout=10)
        engine.shutdown()


def keep_states(processor) -> dict:
    """Every request state the front end is given, kept here (it forgets a request once it finishes)."""
    states, add = {}, processor.add

    def adding(state) -> None:
        states[state.request_id] = state
        add(state)

    processor.add = adding
    return states


@contextlib.contextmanager
def states_kept(processor) -> Iterator[dict]:
    """:func:`keep_states` for the block's duration (a shared engine's front end is left as it was)."""
    had = "add" in vars(processor)
    original = processor.add
    try:
        yield keep_states(processor)
    finally:
        if had:
            processor.add = original
        else:
            del processor.add


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus scrape as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


class ServerProcess:
    """``python -m minipd serve ARGS --port 0`` in its own process group; ``url`` once it listens."""

    def __init__(self, *args: str, start_timeout: float = 180.0) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "minipd", "serve", "--port", "0", *args], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + start_timeout
        self.url = ""
        while not self.url:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError(f"the server did not start in {start_timeout:.0f} s: {self.lines}") from None
            if line is None:
                raise RuntimeError(f"the server exited: {self.lines}")
            if " at http://" in line:
                self.url = line.split(" at ", 1)[1].split("/v1", 1)[0]

    def _read(self, lines: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            lines.put(line)
        lines.put(None)

    def children(self) -> list[int]:
        """Every process this server started (its whole process group but itself)."""
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return [int(p) for p in out if int(p) != self.proc.pid]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None or self.children():
            self.kill()
