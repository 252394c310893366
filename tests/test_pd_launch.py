"""Workers launched one by one (``python -m minipd worker``), as on several machines, joining a front
end that listens (``DisaggregatedLLM(listen=...)``): same outputs as one engine; a killed worker is
noticed by its silence within ``heartbeat_timeout``; ``shutdown`` sends every worker home, and a front end
killed (no shutdown sent) loses its workers ``--front-end-grace`` later; a stopped one keeps them. Each worker (and
front end) is a subprocess bounded in time and killed at the end, also when the test fails.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
from helpers import listen_port

from minipd import LLM, DisaggregatedLLM, SamplingParams
from minipd.pd.transport import nixl_available
from minipd.pd.worker import role_options


@pytest.fixture(autouse=True)
def own_secret(tmp_path, monkeypatch):
    """Each test's front end and workers share a cluster secret of their own (made on first use), not the user's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("MINIPD_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MINIPD_CLUSTER_SECRET_FILE", raising=False)


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def launch(roles: list[str], address: str, *extra: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "minipd", "worker", "--role", role, "--connect", address,
                              "--join-timeout", "120", *extra], env=env()) for role in roles]


def workload() -> tuple[list[str], SamplingParams, list[list[int]]]:
    """Twelve prompts, greedy, and the single engine's tokens for them."""
    prompts = ["def fib(n):", "import os\n", "class Tree:", "for i in range(10):"] * 3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return prompts, params, [o.token_ids for o in LLM("tiny-py").generate(prompts, params, use_tqdm=False)]


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.parametrize("kv_transport", ["nixl", "torch"])
def test_launched_workers_join_serve_and_survive_a_kill(kv_transport):
    if kv_transport == "nixl" and nixl_available() is not None:
        pytest.skip(f"needs NIXL: {nixl_available()}")
    address = f"tcp://127.0.0.1:{listen_port()}"
    workers = launch(["prefill", "decode", "decode"], address)
    try:
        prompts, params, expected = workload()
        with DisaggregatedLLM("tiny-py", num_decode_workers=2, listen=address, kv_transport=kv_transport,
                              heartbeat_timeout=3, kv_lease_s=10, start_timeout=120) as pd:
            pids = pd.worker_pids()
            assert sorted(p for group in pids.values() for p in group) == sorted(w.pid for w in workers)
            outputs = pd.generate(prompts, params)
            assert [o.token_ids for o in outputs] == expected
            assert {o.metrics.decode_worker for o in outputs} == {"decode0", "decode1"}
            if kv_transport == "nixl":  # torch's gloo ranks cannot lose a member: the survivors would hang
                os.kill(pids["decode"][0], signal.SIGKILL)
                start = time.monotonic()
                outputs = pd.generate(prompts, params)
                assert time.monotonic() - start < 30
                assert [o.token_ids for o in outputs] == expected
                assert pd.worker_pids()["decode"] == pids["decode"][1:]  # its silence gave it away
                assert pd.num_recovered_requests > 0
        for w in workers:  # shutdown sent every live worker home
            assert w.wait(timeout=30) in (0, -signal.SIGKILL)
    finally:
        stop(workers)


def test_a_stopped_launched_worker_is_fenced_and_sent_home_when_it_wakes_up():
    if nixl_available() is not None:
        pytest.skip(f"needs NIXL: {nixl_available()}")
    address = f"tcp://127.0.0.1:{listen_port()}"
    workers = launch(["prefill", "decode", "decode"], address)
    try:
        prompts, params, expected = workload()
        with DisaggregatedLLM("tiny-py", num_decode_workers=2, listen=address, heartbeat_timeout=2, kv_lease_s=5,
                              start_timeout=120) as pd:
            stopped = pd.worker_pids()["decode"][0]
            os.kill(stopped, signal.SIGSTOP)
            try:
                start = time.monotonic()
                outputs = pd.generate(prompts, params)
                assert time.monotonic() - start < 30
                assert [o.token_ids for o in outputs] == expected
                assert stopped not in pd.worker_pids()["decode"]
            finally:
                os.kill(stopped, signal.SIGCONT)
            # Awake again, it hears it was let go and leaves; whatever it sent meanwhile was ignored.
            (woken,) = [w for w in workers if w.pid == stopped]
            assert woken.wait(timeout=30) == 0
            assert [o.token_ids for o in pd.generate(prompts, params)] == expected
            assert stopped not in pd.worker_pids()["decode"]
    finally:
        stop(workers)


#: A front end in a process of its own, to be killed or stopped: it prints the length of one answer, then idles.
FRONT_END = """
import sys, time
from minipd import DisaggregatedLLM, SamplingParams
pd = DisaggregatedLLM("tiny-py", listen=sys.argv[1], start_timeout=120)
print(len(pd.generate(["def f(x):"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].token_ids),
      flush=True)
time.sleep(600)
"""


def test_launched_workers_wait_for_a_stopped_front_end_and_leave_a_killed_one(tmp_path):
    """A front end idle, or stopped (it may be resumed), keeps its launched workers; killed (no shutdown sent: its
    connections close), it loses them ``--front-end-grace`` later, and they say why."""
    address = f"tcp://127.0.0.1:{listen_port()}"
    logs = [open(tmp_path / f"worker{i}.log", "w+") for i in range(2)]  # (closed below)
    front, workers = None, []
    try:
        front = subprocess.Popen([sys.executable, "-c", FRONT_END, address], env=env(), stdout=subprocess.PIPE,
                                 text=True)
        workers = [subprocess.Popen([sys.executable, "-m", "minipd", "worker", "--role", role, "--connect", address,
                                     "--join-timeout", "120", "--front-end-grace", "1"], env=env(), stderr=log)
                   for role, log in zip(["prefill", "decode"], logs, strict=True)]
        assert select.select([front.stdout], [], [], 180)[0], "the front end did not serve within 180 s"
        assert front.stdout.readline().strip() == "4"
        time.sleep(3)  # idle
        os.kill(front.pid, signal.SIGSTOP)
        time.sleep(4)  # stopped, longer than the grace
        assert [w.poll() for w in workers] == [None, None]
        front.kill()
        for w in workers:
            assert w.wait(timeout=60) == 1
        for log in logs:
            log.seek(0)
            assert "the connection to the front end at" in (text := log.read()) and "leaving" in text, text
    finally:
        if front is not None:
            front.kill()
            front.wait(timeout=30)
        stop(workers)
        for log in logs:
            log.close()


def test_a_worker_too_many_is_sent_home_and_a_missing_one_times_out():
    address = f"tcp://127.0.0.1:{listen_port()}"
    workers = launch(["prefill", "prefill"], address)
    try:
        with pytest.raises(Exception, match=r"only \{'prefill': 1, 'decode': 0\} of \{'prefill': 1, 'decode': 1\}"):
            DisaggregatedLLM("tiny-py", listen=address, start_timeout=8)
        # One prefill worker was refused at once and left; the other joined, and shutdown sent it home.
        assert sorted(w.wait(timeout=30) for w in workers) == [0, 0]
    finally:
        stop(workers)


def test_the_worker_command_refuses_bad_input_clearly():
    run = [sys.executable, "-m", "minipd", "worker"]
    bad = subprocess.run([*run, "--connect", "tcp://127.0.0.1:9", "--role", "router"], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--role" in bad.stderr and "prefill" in bad.stderr
    lonely = subprocess.run([*run, "--connect", f"tcp://127.0.0.1:{listen_port()}", "--role", "decode",
                             "--join-timeout", "1"], env=env(), capture_output=True, text=True, timeout=60)
    assert lonely.returncode == 2 and "no front end answered" in lonely.stderr


def test_a_prefill_worker_drops_decode_compilation_the_cluster_options_ask_of_decode_workers():
    from minipd.engine.config import EngineConfig

    asked = {"compile_warmup": True, "compile_batch_sizes": [1, 2], "max_num_seqs": 4}
    prefill = role_options("prefill", asked)
    assert prefill["compile_decode"] is False and prefill["compile_warmup"] is False
    EngineConfig.from_options(dict(prefill))  # valid as built (compile_warmup with no compile_decode is refused)
    assert role_options("decode", asked) == asked
    explicit = {"compile_decode": True, "compile_warmup": True}
    assert role_options("prefill", explicit) == explicit  # asked for by name: kept, and checked as given


def test_a_port_found_free_for_later_lies_below_the_ephemeral_range_and_can_be_bound():
    """The port a launched worker offers for torch.distributed's store is bound only after its model has loaded:
    from the ephemeral range, an outgoing connection could take it meanwhile."""
    import socket
    from pathlib import Path

    from minipd.pd.worker import free_port

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 0  # (elsewhere: only that it can be bound)
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1  # chosen at random, not the same one each time
    for port in ports:
        assert 1024 <= port < low if low > 2048 else port > 0
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
