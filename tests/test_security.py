"""What crosses a socket is never unpickled, and nothing listens beyond 127.0.0.1 unless asked.

- Every message type round-trips through :mod:`minipd.wire`; pickles, forged signatures and types
  outside the allowed table are refused without running anything.
- A pickle that would run a shell command is sent to every TCP entry point — a front end's
  ``listen`` socket (before and after its workers join) and a launched worker's inbox — and to a
  spawned cluster's IPC outbox: nothing runs, the processes keep serving, the outputs are exact.
- During runs of each KV transport, every TCP socket the workers listen on is on 127.0.0.1.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq
from helpers import listen_port

from minipd import LLM, DisaggregatedLLM, SamplingParams
from minipd.engine import core_messages as cm
from minipd.engine.core_messages import CoreError, ExportedKV
from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, Request, RequestStatus
from minipd.engine.stats import StepStats
from minipd.kv.block_manager import BlockAllocation
from minipd.kv.paged_pool import PackedKV
from minipd.kv.spec import KVSpec
from minipd.pd import messages as pm
from minipd.pd.kv_layout import PoolLayout
from minipd.pd.transport import nixl_available
from minipd.wire import Codec, WireError, cluster_secret, new_key

PROMPTS = ["def fib(n):", "import os\n", "class Tree:", "for i in range(10):"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------------------- the codec
def test_every_message_type_round_trips():
    codec = Codec(new_key())
    spec = KVSpec(2, 16, 2, 8, torch.float16, scale_shape=(16, 2), scale_dtype=torch.float32, quant="int8")
    request = Request("7", [1, 2, 3], 2, SamplingParams(temperature=0.5, stop=["\n"], seed=-3, logprobs=2), 11,
                      frozenset({0, 5}), 256, 1.25, status=RequestStatus.RUNNING,
                      blocks=BlockAllocation([4, 9], [b"\x00\xff"]), block_hashes=[b"abc"], hold_kv=True)
    outputs = EngineCoreOutputs([EngineCoreOutput("7", [3], FinishReason.STOP, 0, new_logprobs=[{3: -0.5, 9: -1.5}],
                                                  new_prompt_logprobs=[{2: -0.25}])], 3.5, 4)
    kv = PackedKV(spec, 20, [torch.randn(2, 2, 16, 2, 8).half()], [(torch.rand(2, 16, 2), torch.rand(2, 16, 2))],
                  torch.randn(2, 2, 4, 2, 8))
    layout = PoolLayout(((1 << 40, 4096), (1 << 41, 4096)), 2, 64, 0, "DRAM")
    stats = StepStats(1.0, 0.5, 16, 2, 3, 1, 10, 90, 0.25, 0, prefill_chunk_sizes=(16,), worker="decode0")
    peer = {"name": "p", "metadata": b"\x00\x01"}
    protocol = [  # every message of both protocols (checked against their lists below)
        cm.AddRequest(request, None), cm.AddRequest(request, kv), cm.AbortRequests(["1", "2"], FinishReason.STOP),
        cm.ImportKV("7", kv), cm.FinishKVLoad("7"), cm.ExportKV("7", 12), cm.ReleaseKV("7"), cm.Shutdown(),
        cm.CoreReady(12, spec.to_dict(), 64, 256, [0, 5]), CoreError("7", "no"), ExportedKV("7", kv),
        pm.AddRequest(request), pm.AddRemote(request, "prefill0", [3, 4]), pm.AddPush(request, "decode0", [1], True),
        pm.Abort(["7"], FinishReason.ABORT), pm.ReleaseKV("7"), pm.Reserve("7", 40), pm.Adopt(request),
        pm.ReleaseReservation("7", True), pm.AddPeer(peer), pm.InjectFault("lose_reads"), pm.AskStats(),
        pm.Shutdown(), pm.Configure("decode0", "tiny-py", {"block_size": 16}, 30.0, None, {"name": "torch"}),
        pm.Hello("decode", "tcp://127.0.0.1:5000", "127.0.0.1", 5001, 77, (1, 2)),
        pm.Ready(77, peer, 64, spec.to_dict(), {"kernel_backend": "cpu"}, "decode0"),
        pm.Outputs(outputs, {"7": [1, 2]}, {"7": {"prefill_step": (1.0, 2.0)}}, 12, [stats], "prefill0"),
        pm.Reserved("7", None, "decode0"), pm.Reserved("7", [5, 6]),
        pm.KVLoaded("7", 4096, 1.0, 1.5, 1.2, {"layers": [(1.0, 1.1)]}, "decode0"),
        pm.KVFailed("7", "lease ran out", "decode0"), pm.Notice("slow", "prefill0"), pm.Failure("boom", None, "p"),
        pm.Heartbeat("decode0"), pm.Stats(3, 61, 1, "decode0"),
    ]
    assert {type(x) for x in protocol} == set(cm.MESSAGES) | set(pm.MESSAGES)
    for message in [*protocol, outputs, layout, stats, frozenset({1}), {1, 2}, torch.empty(0, 3)]:
        back = codec.decode(codec.encode(message))
        assert type(back) is type(message)
        assert repr(back) == repr(message)
    # A field of the wrong type is refused on arrival (its message is rebuilt, and checked, there).
    import msgpack

    from minipd.wire import _DATACLASS, _pack

    forged = msgpack.packb(msgpack.ExtType(_DATACLASS, _pack(["minipd.pd.messages.Reserve",
                                                             {"request_id": "7", "num_tokens": "40"}])))
    with pytest.raises(WireError, match="num_tokens must be int"):
        Codec().decode(forged)
    back = codec.decode(codec.encode(kv))
    assert back.spec == spec and torch.equal(back.layers[0], kv.layers[0]) and torch.equal(back.tail, kv.tail)
    assert torch.equal(back.scales[0][1], kv.scales[0][1])
    assert back_params_checked(codec)


def back_params_checked(codec: Codec) -> bool:
    """A dataclass is rebuilt through its __init__, so its validation runs on what arrives."""
    import msgpack

    from minipd.wire import _DATACLASS, _pack

    forged = msgpack.packb(msgpack.ExtType(_DATACLASS, _pack(["minipd.sampling_params.SamplingParams",
                                                             {"temperature": -1.0}])))
    with pytest.raises(WireError, match="temperature"):
        Codec().decode(forged)
    return True


def test_pickles_forgeries_and_unknown_types_are_refused_without_running(tmp_path):
    import msgpack

    from minipd.wire import _DATACLASS, _ENUM, _TENSOR, _pack

    marker = tmp_path / "ran"
    key = new_key()
    signed, unsigned, other = Codec(key), Codec(), Codec(new_key())
    evil = pickle.dumps(Payload(marker))
    cases = {
        "a pickle, to a signed channel": (signed, evil, "not signed"),
        "a pickle, to an unsigned channel": (unsigned, evil, "malformed"),
        "another cluster's signature": (signed, other.encode(("shutdown",)), "not signed"),
        "a good signature on changed bytes": (signed, signed.encode(("add", 1))[:-1] + b"\x02", "not signed"),
        "a callable's name": (unsigned, msgpack.packb(msgpack.ExtType(_DATACLASS, _pack(["os.system", {}]))),
                             "not allowed"),
        "an enum's name": (unsigned, msgpack.packb(msgpack.ExtType(_ENUM, _pack(["subprocess.Popen", 1]))),
                          "not allowed"),
        "an unknown field": (unsigned, msgpack.packb(msgpack.ExtType(_DATACLASS, _pack(
            ["minipd.engine.core_messages.CoreError", {"request_id": None, "message": "", "__class__": 1}]))),
                            "no field"),
        "a tensor of an odd dtype": (unsigned, msgpack.packb(msgpack.ExtType(_TENSOR, _pack(
            ["complex128", [1], b"\x00" * 16]))), "dtype"),
        "a tensor with too few bytes": (unsigned, msgpack.packb(msgpack.ExtType(_TENSOR, _pack(
            ["float32", [4], b"\x00" * 8]))), "needs 16 bytes"),
        "empty bytes": (signed, b"", "not signed"),
    }
    for what, (codec, data, why) in cases.items():
        with pytest.raises(WireError, match=why):
            codec.decode(data)
            pytest.fail(f"{what} was accepted")
    assert not marker.exists()
    with pytest.raises(TypeError, match="cannot be put in a message"):
        unsigned.encode(Payload(marker))
    with pytest.raises(ValueError, match="16 bytes"):
        Codec(b"short")


def test_the_cluster_secret_comes_from_the_environment_or_one_private_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("MINIPD_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MINIPD_CLUSTER_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="no cluster secret"):
        cluster_secret()
    made = cluster_secret(create=True)
    path = tmp_path / "minipd" / "cluster-secret"
    assert path.stat().st_mode & 0o777 == 0o600 and len(made) == 64
    assert cluster_secret() == made == cluster_secret(create=True)  # made once, then read
    assert [p.name for p in path.parent.iterdir()] == ["cluster-secret"]  # no staging file left
    monkeypatch.setenv("MINIPD_CLUSTER_SECRET", "x" * 20)
    assert cluster_secret() == b"x" * 20
    assert cluster_secret("y" * 16) == b"y" * 16
    with pytest.raises(ValueError, match="16 bytes"):
        cluster_secret("short")


# ------------------------------------------------------------------------------ the entry points
def send_raw(address: str, *frames: bytes) -> None:
    """Connect to ``address`` as a ZeroMQ PUSH peer (as anyone on the machine could) and send ``frames``."""
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.connect(address)
    for frame in frames:
        socket.send(frame)
    socket.close(linger=3000)
    context.term()


def listening(pids: list[int]) -> list[str]:
    """The local address of every TCP socket these processes listen on."""
    if shutil.which("ss") is None:
        pytest.fail("`ss` (iproute2) is needed to check the listening sockets")
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    return [line.split()[3] for line in lines if any(f"pid={pid}," in line for pid in pids)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny-py").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("kv_transport", ["nixl", "torch"])
def test_spawned_workers_listen_on_loopback_only_and_drop_what_they_cannot_trust(kv_transport, expected, tmp_path):
    if kv_transport == "nixl" and nixl_available() is not None:
        pytest.skip(f"needs NIXL: {nixl_available()}")
    marker = tmp_path / "ran"
    with DisaggregatedLLM("tiny-py", kv_transport=kv_transport, start_timeout=120) as pd:
        pids = [p for group in pd.worker_pids().values() for p in group]
        # The front end's outbox is an IPC socket in a private folder; a process of the same user can
        # still reach it, and what it sends is dropped, not unpickled.
        send_raw(f"ipc://{pd.workers.folder}/out", pickle.dumps(Payload(marker)), pickle.dumps({"kind": "error"}))
        assert [o.token_ids for o in pd.generate(PROMPTS, GREEDY)] == expected
        addresses = listening(pids)
        front_end = listening([os.getpid()])
        if kv_transport == "torch":  # gloo's pairs listen; the front end serves the workers' store
            assert addresses
            assert f"127.0.0.1:{pd.workers._store.port}" in front_end, front_end
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
        assert all(a.startswith("127.0.0.1:") for a in front_end), "the front end listens beyond"
    assert not marker.exists()


def test_a_listening_front_end_and_launched_workers_refuse_pickles_and_keep_serving(expected, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("MINIPD_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("MINIPD_CLUSTER_SECRET_FILE", raising=False)
    marker = tmp_path / "ran"
    evil = pickle.dumps(Payload(marker))
    address = f"tcp://127.0.0.1:{listen_port()}"
    result: dict = {}

    def front_end() -> None:
        try:
            result["pd"] = DisaggregatedLLM("tiny-py", listen=address, kv_transport="torch", start_timeout=120,
                                            heartbeat_timeout=5)
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=front_end, daemon=True)
    thread.start()
    time.sleep(1.0)
    # Stray and hostile packets while the front end waits for its workers: a pickle, a forged hello.
    send_raw(address, evil, b"\x00" * 7, Codec(new_key()).encode({"kind": "hello", "role": "prefill"}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    workers = [subprocess.Popen([sys.executable, "-m", "minipd", "worker", "--role", role, "--connect", address,
                                 "--join-timeout", "120"], env=env) for role in ("prefill", "decode")]
    try:
        thread.join(timeout=150)
        assert "error" not in result, result.get("error")
        pd = result["pd"]
        with pd:
            assert [o.token_ids for o in pd.generate(PROMPTS, GREEDY)] == expected
            addresses = listening([w.pid for w in workers])
            assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
            inboxes = [w.socket.getsockopt_string(zmq.LAST_ENDPOINT) for w in pd.workers.workers.values()]
            assert len(inboxes) == 2 and all(i.startswith("tcp://127.0.0.1:") for i in inboxes), inboxes
            for inbox in inboxes:
                send_raw(inbox, evil, Codec(new_key()).encode(("shutdown",)))
            send_raw(address, evil)  # the front end's socket, once more, with the cluster up
            time.sleep(0.5)
            assert [o.token_ids for o in pd.generate(PROMPTS, GREEDY)] == expected
            assert all(w.poll() is None for w in workers)  # nothing took a worker down
        assert sorted(w.wait(timeout=30) for w in workers) == [0, 0]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait(timeout=30)
    assert not marker.exists()
