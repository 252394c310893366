"""The engine core behind queues: in a thread and in a second process, with the same outputs as in-process;
and what a client sees when the core process is killed or does not answer in time."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import assert_child_exits_with_its_parent, failed_start

from minipd import LLM, SamplingParams
from minipd.engine.core_client import CoreClient, CoreError, EngineDeadError, ExportedKV
from minipd.engine.output_processor import OutputProcessor
from minipd.engine.request import FinishReason, Request
from minipd.tokenizer import Tokenizer

PROMPTS = ["def fib(n):", "import ", "class Stack:", "for i in range(10):", "    return "]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py", seed=0)


def requests_for(llm: LLM, params: list[SamplingParams]) -> list[Request]:
    """Core requests for PROMPTS, made by the in-process front end (ids, seeds and token ids fixed)."""
    return [llm.engine.make_request(p, sp, index=i, request_id=f"r{i}").request
            for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]


def params_list() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=16, seed=11, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=8, stop="\n")]


def collect(client: CoreClient, requests: list[Request], processor: OutputProcessor,
            timeout: float = 60.0) -> dict[str, tuple[list[int], str | None]]:
    """Submit, then read outputs through a front-end processor until every request finished."""
    states = {}
    for r in requests:
        state = processor.new_state(r.request_id, None, r.prompt_token_ids, r.params, time.perf_counter())
        processor.add(state)
        states[r.request_id] = state
        client.add_request(r)
    deadline = time.monotonic() + timeout
    while not all(s.finished for s in states.values()):
        message = client.get_output(timeout=max(0.1, deadline - time.monotonic()))
        assert not isinstance(message, CoreError), message.message
        _, to_abort = processor.process(message)
        if to_abort:
            client.abort_requests(to_abort, FinishReason.STOP)
    return {rid: (s.token_ids, s.text) for rid, s in states.items()}


def in_process_reference(llm: LLM) -> dict[str, tuple[list[int], str | None]]:
    outs = llm.generate(PROMPTS, params_list())
    return {f"r{i}": (o.token_ids, o.text) for i, o in enumerate(outs)}


def test_core_in_a_thread_gives_the_in_process_outputs(llm):
    expected = in_process_reference(llm)
    other = LLM("tiny-py")
    with CoreClient.in_thread(other.engine.core) as client:
        got = collect(client, requests_for(llm, params_list()), OutputProcessor(other.tokenizer))
    assert got == expected
    assert not other.engine.has_unfinished_requests()


def test_thread_safe_submission_from_several_threads(llm):
    expected = in_process_reference(llm)
    other = LLM("tiny-py")
    requests = requests_for(llm, params_list())
    processor = OutputProcessor(other.tokenizer)
    states = [processor.new_state(r.request_id, None, r.prompt_token_ids, r.params, 0.0) for r in requests]
    for state in states:
        processor.add(state)
    with CoreClient.in_thread(other.engine.core) as client:
        threads = [threading.Thread(target=client.add_request, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        deadline = time.monotonic() + 60
        while not all(s.finished for s in states):
            _, to_abort = processor.process(client.get_output(timeout=max(0.1, deadline - time.monotonic())))
            if to_abort:
                client.abort_requests(to_abort, FinishReason.STOP)
    # Arrival order differs from run to run, but each request's tokens do not depend on its neighbours.
    assert {s.request_id: (s.token_ids, s.text) for s in states} == expected


def test_a_refused_request_comes_back_as_an_error_and_the_core_keeps_serving(llm):
    other = LLM("tiny-py")
    with CoreClient.in_thread(other.engine.core) as client:
        bad = requests_for(llm, params_list())[0]
        bad.num_external_tokens = bad.num_tokens  # nothing left to compute: refused
        client.add_request(bad)
        error = client.get_output(timeout=10)
        assert isinstance(error, CoreError) and error.request_id == "r0" and "num_external_tokens" in error.message
        good = requests_for(llm, params_list())
        got = collect(client, good[2:3], OutputProcessor(other.tokenizer))
    assert got["r2"] == in_process_reference(llm)["r2"]


def test_core_in_a_second_process_gives_the_in_process_outputs_then_dies_loudly(llm):
    expected = in_process_reference(llm)
    client = CoreClient.in_process("tiny-py", start_timeout=120)
    try:
        assert client.info.kv_spec == llm.engine.core.kv_spec.to_dict()
        assert client.process.pid != os.getpid()
        got = collect(client, requests_for(llm, params_list()), OutputProcessor(Tokenizer(llm.model_path)))
        assert got == expected
        # Nothing pending: waiting for output hits the timeout rather than hanging.
        with pytest.raises(TimeoutError):
            client.get_output(timeout=0.5)
        # A killed worker: the client says so instead of waiting forever.
        long = requests_for(llm, [SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)] * 5)
        for r in long:
            client.add_request(r)
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.join(timeout=10)
        with pytest.raises(EngineDeadError):
            for _ in range(10_000):
                client.get_output(timeout=5)
        with pytest.raises(EngineDeadError):
            client.add_request(long[0])
    finally:
        client.shutdown()
        assert not client.process.is_alive()


def test_kv_moves_through_the_client_and_a_waiting_request_does_not_spin(llm):
    sender, receiver = LLM("tiny-py"), LLM("tiny-py")
    calls = []
    step = receiver.engine.core.step
    receiver.engine.core.step = lambda: calls.append(1) or step()  # counts the loop's steps, empty ones too
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (expected,) = llm.generate([PROMPTS[0]], params)
    with CoreClient.in_thread(sender.engine.core) as a, CoreClient.in_thread(receiver.engine.core) as b:
        # The sender prefills and keeps the K/V; the client asks for them.
        held = sender.engine.make_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1), request_id="p",
                                          hold_kv=True).request
        a.add_request(held)
        assert a.get_output(timeout=30).outputs[0].finished
        a.export_kv("p")
        exported = a.get_output(timeout=30)
        assert isinstance(exported, ExportedKV) and exported.kv.num_tokens == held.num_prompt_tokens
        a.release_kv("p")
        # The receiver waits for them without burning a core, then continues from the first token.
        first = held.output_token_ids[0]
        rest = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
        waiting = receiver.engine.make_request([*held.prompt_token_ids, first], rest, request_id="d",
                                               num_external_tokens=held.num_prompt_tokens).request
        b.add_request(waiting)
        time.sleep(0.5)
        assert 0 < len(calls) < 100  # about one empty step per 10 ms, not a busy loop
        b.import_kv("d", exported.kv)
        tokens: list[int] = []
        finished = False
        while not finished:
            message = b.get_output(timeout=30)
            tokens += [t for out in message.outputs for t in out.new_token_ids]
            finished = any(out.finished for out in message.outputs)
    assert [first, *tokens] == expected.token_ids
    assert sender.engine.block_manager.num_used_blocks == 0 == receiver.engine.block_manager.num_used_blocks


def test_a_lost_message_is_a_timeout_and_the_client_keeps_working(llm):
    other = LLM("tiny-py")
    with CoreClient.in_thread(other.engine.core) as client:
        requests = requests_for(llm, params_list())
        send = client._send
        client._send = lambda message: None  # the next message is lost on the way
        client.add_request(requests[2])
        client._send = send
        with pytest.raises(TimeoutError):
            client.get_output(timeout=0.5)
        got = collect(client, requests[2:3], OutputProcessor(other.tokenizer))  # sent again, it is served
    assert got["r2"] == in_process_reference(llm)["r2"]


def test_the_core_process_exits_when_its_parent_is_killed_and_removes_the_sockets(tmp_path):
    script = tmp_path / "parent.py"
    folder_file = tmp_path / "folder"
    script.write_text(
        "import pathlib, time\n"
        "from minipd.engine.core_client import CoreClient\n"
        "if __name__ == '__main__':  # the core process is spawned: it imports this file again\n"
        "    client = CoreClient.in_process('tiny-py', start_timeout=120)\n"
        f"    pathlib.Path({str(folder_file)!r}).write_text(client.socket_folder)\n"
        "    print(client.process.pid, flush=True)\n"
        "    time.sleep(600)\n")
    assert_child_exits_with_its_parent(script, "the engine core process")
    folder = folder_file.read_text()
    assert folder and not os.path.exists(folder), f"{folder} left behind"


def test_a_shut_down_or_dropped_client_leaves_no_socket_folder(tmp_path):
    client = CoreClient.in_process("tiny-py", start_timeout=120)
    folder = client.socket_folder
    assert sorted(os.listdir(folder)) == ["in", "out"]
    client.shutdown()
    assert not os.path.exists(folder)
    # Something else in the folder is not ours: the clean-up removes its sockets and leaves the rest.
    client = CoreClient.in_process("tiny-py", start_timeout=120)
    folder, process = client.socket_folder, client.process
    (Path(folder) / "notes.txt").write_text("a user's file")
    try:
        del client  # dropped without a shutdown: the finalizer stops its process and removes its sockets
        gc.collect()
        assert os.listdir(folder) == ["notes.txt"]
        assert not process.is_alive()
    finally:
        process.kill()
        process.join(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_the_shared_front_end_drives_a_core_in_a_thread_or_a_process(llm, where):
    """One front end for every core: FrontEnd over RemoteCore gives LLM.generate's outputs, and aborts reach it."""
    from minipd.engine.front_end import FrontEnd
    from minipd.engine.remote_core import RemoteCore

    params = params_list()
    expected = [(o.token_ids, o.text) for o in llm.generate(PROMPTS, params)]
    if where == "thread":
        own = LLM("tiny-py", num_kv_blocks=40)
        core = RemoteCore(CoreClient.in_thread(own.engine.core), own.max_model_len, 16, 40)
    else:
        core = RemoteCore.in_process("tiny-py", num_kv_blocks=40)
    front = FrontEnd(core, llm.tokenizer, core.max_model_len, llm.engine.eos_token_ids, llm.config.vocab_size, seed=0)
    try:
        states = [front.make_request(p, sp, index=i) for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]
        for state in states:
            front.add(state)
        deadline = time.monotonic() + 60
        while front.has_unfinished_requests():
            assert time.monotonic() < deadline, "the core did not finish"
            front.step()
        assert [(s.token_ids, s.text) for s in states] == expected
        with pytest.raises(ValueError, match="prompts\\[0\\] may grow to"):  # checked against the core's pool
            front.add_request("def f():", SamplingParams(max_tokens=900))
        long = front.make_request("def main():", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        front.add(long)
        while not long.token_ids:
            front.step()
        assert front.abort(long.request_id)
        while front.has_unfinished_requests():
            assert time.monotonic() < deadline + 30, "the abort did not come back"
            front.step()
        assert long.finish_reason == "abort" and len(long.token_ids) < 500
    finally:
        core.shutdown()


def test_a_core_process_stopped_while_starting_times_out_and_is_killed(monkeypatch):
    """A core process wedged before it connects (stopped here as it starts): the start gives up after
    ``start_timeout`` and the process is killed — the goodbye sent to it used to be retried for as long as it
    lived, so the constructor never returned."""
    stopped: list[int] = []
    original = CoreClient._wait_ready

    def stop_then_wait(self, timeout):
        os.kill(self.process.pid, signal.SIGSTOP)
        stopped.append(self.process.pid)
        return original(self, timeout)

    monkeypatch.setattr(CoreClient, "_wait_ready", stop_then_wait)
    try:
        error, took = failed_start(lambda: CoreClient.in_process("tiny-py", start_timeout=2), stopped)
        assert isinstance(error, TimeoutError) and "not ready after 2 s" in str(error)
        assert took < 20  # the start timeout, a second of patience, then a kill
        (pid,) = stopped
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "the stopped core process was left behind"
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
