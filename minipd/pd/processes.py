"""The worker processes of a disaggregated cluster, and the sockets to them: start, join, talk, fence, stop.

A :class:`WorkerGroup` owns the prefill and decode workers (:mod:`minipd.pd.worker`) — spawned here,
or launched by hand (or ``torchrun``) and joined at a ``listen`` address — and the ZeroMQ sockets:
one inbox per worker, one outbox they all report to. Every message is typed and signed
(:mod:`minipd.wire`); what is not signed with the cluster's key, not well formed, or comes from a
worker that is unknown or fenced is dropped, never acted on. It knows nothing of requests: that is
the cluster core's business (:mod:`minipd.pd.cluster`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from minipd.pd import messages as m
from minipd.pd.transport import host_store
from minipd.pd.worker import run_worker
from minipd.wire import Codec, receive, send_nowait

logger = logging.getLogger("minipd")


class WorkerError(RuntimeError):
    """A worker failed to start, or every worker is gone."""


@dataclass
class Worker:
    """The front end's view of one worker process."""

    name: str
    role: str
    process: Any
    socket: Any
    pid: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    peer: dict | None = None
    requests: set[str] = field(default_factory=set)
    #: When the front end last heard from it, and how long a silence means it is dead (0: not judged
    #: yet, while it loads).
    last_seen: float = 0.0
    silence_limit: float = 0.0
    #: Declared dead: nothing it says is heard any more, and it is never routed to again.
    fenced: bool = False
    #: What its engine runs with (``EngineCore.describe()``, as the worker reported it when ready).
    engine: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        if self.fenced or (self.process is not None and not self.process.is_alive()):
            return False
        return not self.silence_limit or time.monotonic() - self.last_seen < self.silence_limit

    @property
    def num_requests(self) -> int:
        """Requests it holds now (for routing)."""
        return len(self.requests)


@dataclass
class Transport:
    """How the workers move K/V: ``name`` ("nixl" or "torch") and, for torch, the wire's dtype."""

    name: str
    wire_dtype: str | None = None


class WorkerGroup:
    """The workers of one cluster and the signed sockets to them.

    Args:
        codec: signs and checks every message (a fresh key for spawned workers, the cluster secret for
            launched ones).
        heartbeat_timeout: a worker silent this long (once ready) is taken for dead.
    """

    def __init__(self, codec: Codec, heartbeat_timeout: float) -> None:
        self.codec = codec
        self.heartbeat_timeout = heartbeat_timeout
        self.workers: dict[str, Worker] = {}
        self.closed = False
        #: The private folder of the IPC sockets of spawned workers (None for a joined cluster).
        self.folder: str | None = None
        self._context: Any = None
        self._pull: Any = None
        #: The torch.distributed store spawned workers meet at (torch transport only), served from here.
        self._store: Any = None

    # ------------------------------------------------------------------------------- starting
    def start(self, model: str, num_prefill: int, num_decode: int, kv_lease_s: float, threads: int | None,
              timeout: float, llm_options: dict, transport: Transport) -> None:
        """Spawn the workers on this machine (IPC sockets in a private folder) and wait until they are ready."""
        import zmq

        self._context = zmq.Context()
        self.folder = tempfile.mkdtemp(prefix="minipd-pd-")
        outbox = f"ipc://{self.folder}/out"
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(outbox)
        spawn = mp.get_context("spawn")
        world = num_prefill + num_decode
        address = ""
        if transport.name == "torch":
            # The front end serves the workers' store itself, on a port the system hands it: a port
            # probed free here and bound later by a worker may be taken in between.
            self._store, address = host_store("127.0.0.1")
        try:
            for role, count in (("prefill", num_prefill), ("decode", num_decode)):
                for index in range(count):
                    name = f"{role}{index}"
                    inbox = f"ipc://{self.folder}/{name}"
                    socket = self._context.socket(zmq.PUSH)
                    socket.bind(inbox)
                    settings = {"name": transport.name, "rank": len(self.workers), "world_size": world,
                                "address": address, "wire_dtype": transport.wire_dtype, "store_hosted": True}
                    process = spawn.Process(target=run_worker, name=f"minipd-{name}", daemon=True,
                                            args=(role, index, model, llm_options, inbox, outbox, kv_lease_s,
                                                  threads, settings, self.codec.key))
                    process.start()
                    self.workers[name] = Worker(name, role, process, socket)
            self._wait_ready(timeout)
            self._introduce()
        except BaseException:
            self.close()
            raise

    def join(self, model: str, listen: str, num_prefill: int, num_decode: int, kv_lease_s: float,
             threads: int | None, timeout: float, llm_options: dict, transport: Transport) -> None:
        """Wait for launched workers to say hello at ``listen``, then configure them and wait until ready."""
        import zmq

        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        hellos: list[tuple[str, m.Hello]] = []  # in the order they came, with the name each worker was given
        try:
            bind_patiently(self._pull, listen)
            wanted = {"prefill": num_prefill, "decode": num_decode}
            deadline = time.monotonic() + timeout
            while len(hellos) < num_prefill + num_decode:
                if time.monotonic() > deadline:
                    have = {r: sum(h.role == r for _, h in hellos) for r in wanted}
                    raise WorkerError(f"only {have} of {wanted} workers joined at {listen} in {timeout:.0f} s")
                message = self.receive(0.2)
                if not isinstance(message, m.Hello):
                    continue
                if message.role not in wanted or not message.inbox.startswith("tcp://"):
                    logger.warning("ignored a malformed hello at %s: %.200r", listen, message)
                    continue
                socket = self._context.socket(zmq.PUSH)
                socket.connect(message.inbox)
                joined = sum(h.role == message.role for _, h in hellos)
                if joined >= wanted[message.role]:
                    socket.send(self.codec.encode(m.Shutdown()))  # one too many of its role: send it home
                    socket.close(linger=1000)
                    continue
                # Registered at once, so that close() sends it home whatever happens next.
                name = f"{message.role}{joined}"
                self.workers[name] = Worker(name, message.role, None, socket, pid=message.pid,
                                            last_seen=time.monotonic())
                hellos.append((name, message))
            ranks = [h.torchrun for _, h in hellos]
            if all(ranks):  # torchrun numbered them and set up the rendezvous
                address, order = "env://", [r[0] for r in ranks]  # type: ignore[index]
            else:  # rank 0 hosts torch.distributed's store, on the port it found free
                first = hellos[0][1]
                address, order = f"tcp://{first.host}:{first.free_port}", list(range(len(hellos)))
            for (name, _), rank in zip(hellos, order, strict=True):
                settings = {"name": transport.name, "rank": rank, "world_size": len(hellos), "address": address,
                            "wire_dtype": transport.wire_dtype}
                self.send(self.workers[name], m.Configure(name, model, llm_options, float(kv_lease_s), threads,
                                                          settings))
            self._wait_ready(max(1.0, deadline - time.monotonic()))
            self._introduce()
        except BaseException:
            self.close()
            raise

    def _introduce(self) -> None:
        """Tell every worker how to reach every other: readers their sources, writers their destinations
        (any mode may be chosen later), and for torch every rank its partners."""
        for worker in self.workers.values():
            for peer in self.workers.values():
                if peer is not worker:
                    self.send(worker, m.AddPeer(peer.peer or {}))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = set(self.workers)
        while waiting:
            if time.monotonic() > deadline:
                raise WorkerError(f"workers {sorted(waiting)} were not ready after {timeout:.0f} s")
            message = self.receive(0.2)
            if message is None:
                # (A launched worker says nothing while it loads: only its start timeout bounds it.)
                dead = [n for n in waiting if self.workers[n].process is not None and not self.workers[n].alive]
                if dead:
                    raise WorkerError(f"worker {dead[0]} exited while starting")
                continue
            if isinstance(message, m.Failure):
                raise WorkerError(message.message)
            if isinstance(message, m.Ready):
                worker = self.workers[message.worker]
                worker.pid, worker.peer = message.pid, message.peer
                worker.free_blocks = worker.num_blocks = message.num_kv_blocks
                worker.engine = dict(message.engine)
                # From now on its silence is judged (loading the model may take any time).
                worker.last_seen, worker.silence_limit = time.monotonic(), self.heartbeat_timeout
                waiting.discard(worker.name)

    # -------------------------------------------------------------------------------- talking
    def role(self, role: str) -> list[Worker]:
        """The live workers of ``role`` ("prefill" or "decode")."""
        return [w for w in self.workers.values() if w.role == role and w.alive]

    def send(self, worker: Worker, message: m.Message, patience: float | None = None) -> None:
        """Send ``message`` to ``worker`` (a WorkerError if it cannot take it and is dead, or, with ``patience``,
        has not taken it after that many seconds)."""
        send_nowait(worker.socket, self.codec.encode(message), lambda: worker.alive, WorkerError,
                    f"worker {worker.name}", patience)

    def receive(self, timeout: float) -> m.Message | None:
        """The next message from a worker (waiting up to ``timeout`` for one); None when none came.

        A message that is not signed with this cluster's key, not well formed, or from a worker that is
        unknown or fenced is logged and dropped: it is never acted on."""
        deadline = time.monotonic() + timeout
        while (message := receive(self._pull, self.codec, max(0.0, deadline - time.monotonic()),
                                  "minipd front end")) is not None:
            if not isinstance(message, m.Message):
                logger.warning("dropped a message that is not a worker's report: %.200r", message)
                continue
            if isinstance(message, m.Hello):
                return message
            worker = self.workers.get(getattr(message, "worker", ""))
            if worker is None or worker.fenced:
                continue  # a worker declared dead: whatever it says now is too late
            worker.last_seen = time.monotonic()
            return message
        return None

    def fence(self, worker: Worker) -> None:
        """Declare ``worker`` dead: never hear or route to it again, and stop it."""
        worker.fenced = True
        if worker.process is not None:
            # Ours to stop: a stopped or wedged process must not wake up and write K/V into blocks that
            # were given to other requests meanwhile.
            with contextlib.suppress(Exception):
                os.kill(worker.process.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(Exception):  # a launched worker: tell it to leave, should it come back
                import zmq

                worker.socket.send(self.codec.encode(m.Shutdown()), flags=zmq.NOBLOCK)

    # ------------------------------------------------------------------------------- stopping
    def close(self) -> None:
        """Stop every worker (killing those that do not stop within 10 s) and free the sockets; idempotent."""
        if self.closed:
            return
        self.closed = True
        for worker in self.workers.values():
            told = False
            # A launched worker may only look dead because nobody listened to its heartbeats: tell it anyway.
            if worker.process is None or worker.alive:
                # (Briefly: a worker stopped or stuck before it connected never takes the message, and waiting
                # for it to would hang here for ever; ours are then killed, a launched one is beyond reach.)
                with contextlib.suppress(Exception):
                    self.send(worker, m.Shutdown(), patience=1.0)
                    told = True
            if worker.process is not None and (worker.fenced or not told):
                worker.process.kill()  # (already killed when fenced; a stopped one may not have died yet)
        deadline = time.monotonic() + 10
        for worker in self.workers.values():
            if worker.process is None:  # launched by hand: not ours to kill; the message must get out
                worker.socket.close(linger=2000)
                continue
            worker.process.join(timeout=max(0.1, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=10)
            worker.socket.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)
            # (destroy, not term: a socket left open by a bind or connect that failed would make term wait for ever)
            self._context.destroy(linger=0)
        self._store = None  # its server stops with the last reference, once every worker is gone
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def bind_patiently(socket: Any, address: str, within: float = 3.0) -> None:
    """Bind ``socket`` to ``address``, trying again for up to ``within`` seconds while the port is in use.

    Workers started before their front end retry their connects to its address, and on this machine a retried
    connect to a port inside the system's ephemeral range can be given that port as its own source (a TCP
    self-connect) and hold it for a moment; so can any outgoing connection. A port still taken after ``within``
    seconds is another program's: a WorkerError says so."""
    import errno

    import zmq

    deadline = time.monotonic() + within
    while True:
        try:
            socket.bind(address)
            return
        except zmq.ZMQError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() > deadline:
                raise WorkerError(f"cannot listen at {address}: the port is in use (by another program, or "
                                  f"another front end); choose another one") from None
            time.sleep(0.1)


__all__ = ["Transport", "Worker", "WorkerError", "WorkerGroup", "bind_patiently"]
