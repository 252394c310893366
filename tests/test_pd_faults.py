"""Faults of a disaggregated engine that are not a clean death: a worker stopped (SIGSTOP) is taken for
dead after ``heartbeat_timeout`` and fenced; an expert-parallel rank dying under a worker is recovered
inside ``generate``; ``abort`` (and closing a stream) reaches the request wherever it is; a dropped
``DisaggregatedLLM`` stops its workers; bad arguments are refused before any process starts. Every
test bounds its workers in time and shuts them down, also when it fails.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import threading
import time

import pytest
from helpers import failed_start
from pd_helpers import assert_gone, llm, mixed, needs_nixl, run_killing, tokens, wait_until_blocks_free

from minipd import LLM, DisaggregatedLLM, SamplingParams

__all__ = ["llm"]  # a fixture, imported for pytest


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            assert_gone([pid])
            return
        except AssertionError:
            time.sleep(0.1)
    assert_gone([pid])


@needs_nixl
@pytest.mark.parametrize(("role", "after_tokens"), [("prefill", 0), ("decode", 60)])
def test_a_stopped_worker_is_fenced_and_its_requests_finish_elsewhere(llm, role, after_tokens):
    prompts, params = mixed(llm, 16)
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", heartbeat_timeout=2, kv_lease_s=2, start_timeout=120) as pd:
        victim = pd.worker_pids()[role][0]
        try:
            start = time.monotonic()
            outputs = run_killing(pd, prompts, params, role, after_tokens, sig=signal.SIGSTOP)
            assert time.monotonic() - start < 60
            assert tokens(outputs) == expected  # every request finished, on the other worker
            assert pd.num_recovered_requests > 0  # it was stopped holding requests
            assert victim not in pd.worker_pids()[role]
            wait_gone(victim)  # fenced: a process of ours that went silent is killed, so it cannot wake up
            outputs = pd.generate(prompts[:4], params[:4])  # one worker serves both roles from now on
            assert tokens(outputs) == expected[:4]
            wait_until_blocks_free(pd)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)


@needs_nixl
def test_an_expert_parallel_rank_dying_under_a_worker_is_recovered_inside_generate():
    prompts = ["def fib(n):", "import os\n", "class Tree:", "for i in range(10):"] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny-py-moe", moe_backend="loop").generate(prompts, params)]
    with DisaggregatedLLM("tiny-py-moe", moe_backend="loop", expert_parallel_size=2, num_decode_workers=2,
                          kv_lease_s=2, start_timeout=120) as pd:
        decoder = pd.worker_pids()["decode"][0]
        ids = [pd.add_request(p, params) for p in prompts]
        states = [pd.processor.states[i] for i in ids]
        received, killed, deadline = 0, False, time.monotonic() + 120
        while not all(s.finished for s in states):  # no WorkerError escapes while a decode worker remains
            assert time.monotonic() < deadline, "requests not finished in 120 s"
            received += len(pd.step())
            if not killed and received >= 20:
                ranks = subprocess.run(["pgrep", "-P", str(decoder), "-f", "minipd.engine.expert_ranks"],
                                       capture_output=True, text=True).stdout.split()
                assert ranks, "the decode worker has no expert-parallel rank"
                os.kill(int(ranks[0]), signal.SIGKILL)
                killed = True
        assert killed
        assert [s.to_output().token_ids for s in states] == expected
        assert pd.num_recovered_requests > 0
        assert decoder not in pd.worker_pids()["decode"]  # the worker whose rank died left the cluster


@needs_nixl
@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_abort_reaches_the_request_at_every_stage_and_frees_its_blocks(llm, mode):
    prompts, params = mixed(llm, 12)
    params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)] * len(prompts)
    survivors = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = tokens(llm.generate(prompts[:2], survivors))
    with DisaggregatedLLM("tiny-py", kv_transfer=mode, kv_lease_s=5, start_timeout=120) as pd:
        ids = [pd.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        states = [pd.processor.states[i] for i in ids]
        assert pd.abort(ids[0]) is True  # at once: queued, or reserving, or prefilling (one id: as LLM.abort)
        for _ in range(3):
            pd.step(0.01)
        pd.abort(ids[1:6])  # early on: prefilling, in transfer or just decoding
        deadline = time.monotonic() + 60
        while sum(len(s.token_ids) for s in states[6:]) < 30:
            assert time.monotonic() < deadline
            pd.step()
        assert sorted(pd.abort([*ids[6:], "no-such-request"])) == sorted(ids[6:])  # decoding
        assert all(s.finished for s in states) and {s.to_output().finish_reason for s in states} == {"abort"}
        assert all(len(s.token_ids) < 200 for s in states)
        assert not pd.has_unfinished_requests()
        wait_until_blocks_free(pd)  # every worker let go of every aborted request's blocks
        assert tokens(pd.generate(prompts[:2], survivors)) == expected  # and the cluster serves on
        with pytest.raises(ValueError, match="request_id") as refused:
            pd.abort([1, 2])
        assert refused.value.param == "request_id"


@needs_nixl
def test_closing_a_stream_aborts_its_request_on_the_worker(llm):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with DisaggregatedLLM("tiny-py", kv_lease_s=5, start_timeout=120) as pd:
        stream = pd.stream("def main():", params)
        first = [next(stream) for _ in range(2)]
        assert [d.request_id for d in first] == [stream.request_id] * 2
        stream.close()
        assert not pd.has_unfinished_requests()
        stats = wait_until_blocks_free(pd)  # the decode worker stopped decoding it and freed its blocks
        assert all(s["live_requests"] == 0 for s in stats.values())


@needs_nixl
def test_a_dropped_front_end_stops_its_workers():
    pd = DisaggregatedLLM("tiny-py", start_timeout=120)
    pids = [p for group in pd.worker_pids().values() for p in group]
    try:
        del pd
        gc.collect()
        for pid in pids:
            wait_gone(pid, timeout=20)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_bad_arguments_are_refused_before_any_worker_starts(monkeypatch):
    import multiprocessing

    def no_processes(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(multiprocessing.get_context("spawn"), "Process", no_processes)
    for options, field in [(dict(kv_lease_s=True), "kv_lease_s"), (dict(kv_lease_s=0), "kv_lease_s"),
                           (dict(seed="abc"), "seed"), (dict(threads_per_worker=-1), "threads_per_worker"),
                           (dict(threads_per_worker="2"), "threads_per_worker"),
                           (dict(heartbeat_timeout=0.5), "heartbeat_timeout"),
                           (dict(start_timeout=-1), "start_timeout")]:
        with pytest.raises(ValueError, match=field):
            DisaggregatedLLM("tiny-py", **options)


@needs_nixl
def test_a_shut_down_front_end_refuses_work_clearly():
    pd = DisaggregatedLLM("tiny-py", start_timeout=120)
    pd.shutdown()
    for call in (lambda: pd.stream("x"), lambda: pd.generate("x"), lambda: pd.add_request("x")):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


@needs_nixl
def test_a_shutdown_from_another_thread_waits_for_the_step_under_way():
    """ZeroMQ sockets are not thread-safe: a shutdown must not close them under a step another thread is taking."""
    pd = DisaggregatedLLM("tiny-py", start_timeout=120)
    try:
        closed_at: list[float] = []
        close = pd.workers.close

        def timed_close() -> None:
            closed_at.append(time.monotonic())
            close()

        pd.workers.close = timed_close
        stepping = threading.Event()

        def long_step() -> None:  # a step that holds the front end for a second
            with pd._lock:
                stepping.set()
                time.sleep(1.0)
                released.append(time.monotonic())

        released: list[float] = []
        thread = threading.Thread(target=long_step, daemon=True)
        thread.start()
        stepping.wait(10)
        pd.shutdown()
        thread.join(10)
        assert closed_at and released and closed_at[0] >= released[0]
        with pytest.raises(RuntimeError, match="shut down"):
            pd.step()
    finally:
        pd.shutdown()


@needs_nixl
def test_a_release_that_finds_its_worker_gone_does_not_end_the_run(llm, monkeypatch):
    # A worker killed a moment before a release (of a reservation, of held K/V) reaches it: the send fails. Its
    # death is the pump's to notice and recover; the release itself is moot (a dead worker keeps nothing). Here
    # every release fails as if its worker had just died, and the run still gives the colocated engine's tokens.
    from minipd.pd.processes import WorkerError

    prompts, params = mixed(llm, 8)
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", kv_transfer="pull", start_timeout=120) as pd:
        cluster = pd.engine.core
        send = cluster.workers.send
        failed: list[str] = []

        def send_or_fail(worker, message):
            if type(message).__name__ in ("ReleaseReservation", "ReleaseKV"):
                failed.append(type(message).__name__)
                raise WorkerError(f"worker {worker.name} is gone")
            return send(worker, message)

        monkeypatch.setattr(cluster.workers, "send", send_or_fail)
        assert tokens(pd.generate(prompts, params)) == expected
        assert failed  # releases were sent, and failed


def test_a_worker_stopped_while_starting_times_the_start_out_and_is_killed(monkeypatch):
    """A spawned worker wedged before it connects (stopped here as it starts): the start gives up after
    ``start_timeout`` and every worker is killed — the goodbye sent to it used to be retried for as long as it
    lived, so the constructor never returned."""
    from minipd.pd import processes

    stopped: list[int] = []
    original = processes.WorkerGroup._wait_ready

    def stop_then_wait(self, timeout):
        for worker in self.workers.values():
            os.kill(worker.process.pid, signal.SIGSTOP)
            stopped.append(worker.process.pid)
        return original(self, timeout)

    monkeypatch.setattr(processes.WorkerGroup, "_wait_ready", stop_then_wait)
    try:
        error, took = failed_start(lambda: DisaggregatedLLM("tiny-py", start_timeout=2), stopped)
        assert "were not ready after 2 s" in str(error)
        assert took < 20  # the start timeout, a second of patience, then a kill
        assert len(stopped) == 2
        for pid in stopped:
            wait_gone(pid)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_send_to_a_socket_nobody_connected_to_gives_up_after_its_patience(tmp_path):
    import zmq

    from minipd.pd.processes import WorkerError
    from minipd.wire import send_nowait

    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        push.bind(f"ipc://{tmp_path}/nobody")
        began = time.monotonic()
        with pytest.raises(WorkerError, match=r"took no message for 0\.2 s"):
            send_nowait(push, b"hello", lambda: True, WorkerError, "nobody", patience=0.2)
        assert time.monotonic() - began < 2
        with pytest.raises(WorkerError, match="is gone"):  # a peer known dead: at once, patience or not
            send_nowait(push, b"hello", lambda: False, WorkerError, "nobody", patience=60)
        # Waiting costs no CPU (it polls for room, not a busy loop), and a peer found gone meanwhile ends it.
        asked = []
        cpu, began = time.process_time(), time.monotonic()
        with pytest.raises(WorkerError, match="is gone"):
            send_nowait(push, b"hello", lambda: asked.append(1) or len(asked) < 20, WorkerError, "nobody")
        assert 0.5 < time.monotonic() - began < 10  # 20 looks at most 50 ms apart
        assert time.process_time() - cpu < 0.2
    finally:
        push.close(linger=0)
        context.term()


def test_closing_a_worker_group_with_a_socket_left_open_returns(tmp_path):
    """A bind or connect that failed on the way in can leave a socket open in the group's context (a hello with
    an unusable inbox did): closing must not wait for it for ever."""
    import zmq

    from minipd.pd.processes import WorkerGroup
    from minipd.wire import Codec, new_key

    group = WorkerGroup(Codec(new_key()), 5.0)
    group._context = zmq.Context()
    group._pull = group._context.socket(zmq.PULL)
    group._pull.bind(f"ipc://{tmp_path}/out")
    left_open = group._context.socket(zmq.PUSH)
    left_open.connect(f"ipc://{tmp_path}/nobody")
    closing = threading.Thread(target=group.close, daemon=True)
    closing.start()
    closing.join(timeout=20)
    assert not closing.is_alive(), "close() waited for a socket left open"


def test_a_front_end_binds_a_port_held_for_a_moment_and_names_one_held_for_good():
    """A port taken briefly (a worker's retried connect can self-connect to it) is bound once free; one another
    program keeps gives a clear error naming the address."""
    import socket

    import zmq

    from minipd.pd.processes import WorkerError, bind_patiently

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    threading.Timer(0.5, holder.close).start()
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    try:
        bind_patiently(pull, f"tcp://127.0.0.1:{port}", within=10)  # free after half a second
        other = context.socket(zmq.PULL)
        try:
            began = time.monotonic()
            with pytest.raises(WorkerError, match=rf"cannot listen at tcp://127\.0\.0\.1:{port}: the port is in use"):
                bind_patiently(other, f"tcp://127.0.0.1:{port}", within=0.5)
            assert 0.4 < time.monotonic() - began < 5
        finally:
            other.close(linger=0)
    finally:
        pull.close(linger=0)
        holder.close()
        context.term()
