"""A prefill or decode worker: one process, one engine core with its own KV pool, one KV connector.

The worker serves messages from the front end (:class:`~minipd.pd.llm.DisaggregatedLLM`) over ZeroMQ
and steps its core while it has work; its KV connector (:mod:`minipd.pd.connector`) decides about
blocks (scheduler side) and moves bytes (worker side):

- a **prefill** worker runs requests up to their first token. With ``"pull"`` it keeps their blocks
  (``hold_kv``), tells the front end which blocks hold each request's K/V, and frees them when the
  decode worker's read is done (a transport notification) or when the lease runs out. With
  ``"push"``/``"layerwise"`` it writes them into blocks a decode worker reserved, and frees them when
  every write is done;
- a **decode** worker admits a request whose prompt K/V are elsewhere (``num_external_tokens``) and
  reads them into its own blocks once they are allocated; or reserves blocks for a writer and admits
  the request once the writer says they are filled. Then it decodes.

The messages both ways are the typed dataclasses of :mod:`minipd.pd.messages` (commands in:
``AddRequest``, ``AddRemote``, ``AddPush``, ``Reserve``, ``Adopt``, ``ReleaseReservation``, ``Abort``,
``ReleaseKV``, ``AddPeer``, ``AskStats``, ``InjectFault``, ``Shutdown``; reports out: ``Ready``,
``Outputs``, ``Reserved``, ``KVLoaded``, ``KVFailed``, ``Stats``, ``Notice``, ``Heartbeat``, ``Failure``).

Both directions go through :class:`minipd.wire.Codec`: typed MessagePack, signed with the front
end's key (nothing is unpickled), so a stray or forged packet is dropped with a warning. A worker
reports at least every :data:`HEARTBEAT_INTERVAL` seconds; after an error that leaves its engine
unusable it reports it and exits. It also leaves when its front end's process is gone without a
``Shutdown`` (killed, crashed): a spawned worker when its parent process is no more, a launched one
shortly after its connection to the front end closes (:class:`FrontEndWatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import sys
import threading
import time
import traceback
from typing import Any

from minipd.pd import messages as m
from minipd.wire import Codec, cluster_secret, receive, send_nowait

#: How long a launched worker goes on, once its connection to the front end has closed, before it leaves (a
#: shutdown sent just before may still be on its way, over the other connection).
FRONT_END_GRACE = 5.0
#: How long the loop waits for a message when transfers or leases need watching.
POLL_INTERVAL = 0.005
#: Every worker reports at least this often, so the front end can tell a silent (stopped, wedged or
#: unreachable) worker from a busy one.
HEARTBEAT_INTERVAL = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, to be bound later (torch.distributed's store, hosted by
    a launched worker once it has loaded its model): below the system's ephemeral range where there is room
    (Linux's ``ip_local_port_range``). A port of that range, free now, can be taken before it is bound as the
    source port of any outgoing connection, and a connect to it retried while nothing listens yet can even be
    given it as its own source (a TCP self-connect); a port below the range is taken only by a listener asking
    for it by number."""
    import random
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    host = host.strip("[]")
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # (Linux's default; elsewhere only a likely choice, still probed)
    choose = random.Random()
    for _ in range(200 if low > 2048 else 0):  # (no room below the range: any port, as the system hands them out)
        port = choose.randrange(max(1024, low - 12000), low)
        with socket.socket(family) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class FrontEndGone(ConnectionError):
    """The front end can no longer be reached: the worker has nobody to serve."""


class FrontEndWatch:
    """Whether a launched worker's front end is still there, from the worker's connection to it.

    The worker's outbox connects to the front end. When the front end's process ends without a shutdown
    (killed, crashed), its operating system closes that connection, and a ZeroMQ socket monitor sees it go.
    From then on the front end counts as gone ``grace`` seconds later (time for a shutdown already sent to
    arrive), even if a connection comes up again: a new front end at the same address does not know this
    worker. A stopped front end keeps its connections, and its workers: it may be resumed. One whose machine
    became unreachable is noticed only when TCP gives up on the connection (on Linux, after some 15 minutes of
    unanswered retransmissions). (ZeroMQ's own pings would notice sooner, but they go unanswered, and the
    connection is dropped and remade with messages reordered or lost, whenever the front end merely stops
    reading: its inbox full while it is not pumping.) Call :meth:`alive` often: it reads the events as they come.
    """

    def __init__(self, socket: Any, grace: float = FRONT_END_GRACE) -> None:
        import zmq

        self.socket, self.grace = socket, grace
        # Before the socket connects, so that its first handshake is not missed.
        self.monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.lost_at: float | None = None

    def alive(self) -> bool:
        """False from ``grace`` seconds after the connection to the front end first closed."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self.lost_at is None and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost_at = time.monotonic()
        return self.lost_at is None or time.monotonic() - self.lost_at < self.grace

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)


def role_options(role: str, llm_options: dict) -> dict:
    """The engine options a worker of ``role`` builds its engine with: a prefill worker takes no decode step, so
    under ``compile_decode="auto"`` it compiles none and ignores ``compile_warmup`` (which the cluster's options
    carry for the decode workers); an explicit ``compile_decode=True`` is kept (and checked) as given."""
    if role == "prefill" and llm_options.get("compile_decode", "auto") == "auto":
        return {**llm_options, "compile_decode": False, "compile_warmup": False}
    return llm_options


def run_worker(role: str, index: int, model: str, llm_options: dict, inbox: str, outbox: str,
               kv_lease_s: float, threads: int | None, transport: dict, key: bytes) -> None:
    """Entry point of a worker process spawned by the front end (it ends when its parent does).

    ``key`` signs every message both ways (a fresh one per front end)."""
    import zmq
    from tqdm.std import tqdm

    # tqdm's default lock includes a multiprocessing semaphore (the compiler makes progress bars, even hidden
    # ones): the os._exit below would leave it registered, and the front end's exit would warn of a leak.
    tqdm.set_lock(threading.RLock())
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(inbox)
    push = context.socket(zmq.PUSH)
    push.connect(outbox)
    parent = os.getppid()
    try:
        _serve(f"{role}{index}", role, model, llm_options, kv_lease_s, threads, transport, pull, push,
               lambda: os.getppid() == parent, Codec(key))
    finally:
        push.close(linger=1000)
        pull.close(linger=0)
        context.term()
    # Served and cleaned up: what is left (the model, the K/V pool, gloo's and UCX's state) goes back with
    # the process. The interpreter's own teardown of it took seconds, which a server's SIGTERM waited on.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_launched_worker(connect: str, role: str | None = None, host: str = "127.0.0.1",
                        num_prefill_workers: int = 1, join_timeout: float = 300.0,
                        secret: str | bytes | os.PathLike | None = None,
                        front_end_grace: float = FRONT_END_GRACE) -> int:
    """Entry point of ``python -m minipd worker``: a worker started by hand (or by ``torchrun``), on this
    machine or another, that joins a front end listening at ``connect``.

    It binds its own inbox on ``host`` (the address the front end reaches it at), says hello with its
    role, and receives from the front end everything else: the model, engine options, its name and
    the KV transport. Every message both ways is signed with the cluster secret
    (:func:`minipd.wire.cluster_secret`: ``secret``, else ``MINIPD_CLUSTER_SECRET``, else the
    user's secret file); a message that is not is logged and dropped. Under ``torchrun`` the role may
    be left out: ranks below ``num_prefill_workers`` prefill, the others decode, and the ``torch``
    transport uses torchrun's rendezvous. It serves
    until the front end shuts it down (exit status 0), or, if the front end's process ends without a shutdown
    (killed, crashed), until ``front_end_grace`` seconds after its connection to the front end closed
    (:class:`FrontEndWatch`; it says so on stderr and returns 1), or it is killed.
    """
    import zmq

    rank = os.environ.get("RANK")
    if role is None:
        if rank is None:
            raise ValueError("role must be 'prefill' or 'decode' (or leave it out under torchrun, which sets RANK)")
        role = "prefill" if int(rank) < num_prefill_workers else "decode"
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    if not front_end_grace >= 0:
        raise ValueError(f"front_end_grace must be >= 0 seconds, got {front_end_grace!r}")
    codec = Codec(cluster_secret(secret, create=True))
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    watch = FrontEndWatch(push, front_end_grace)
    pull = context.socket(zmq.PULL)
    try:
        push.connect(connect)
        pull.bind(f"tcp://{host}:*")
        hello = m.Hello(role, pull.getsockopt_string(zmq.LAST_ENDPOINT), host,
                        free_port(host),  # in case it hosts torch.distributed's store
                        os.getpid(), None if rank is None else (int(rank), int(os.environ.get("WORLD_SIZE", "1"))))
        push.send(codec.encode(hello))
        deadline = time.monotonic() + join_timeout
        while True:  # the first signed message from the front end; anything else is dropped
            if not pull.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"no front end answered at {connect} within {join_timeout:.0f} s")
            message = receive(pull, codec, 0, "minipd worker")
            if isinstance(message, (m.Configure, m.Shutdown)):
                break
        if not isinstance(message, m.Configure):
            return 0  # refused (the front end has enough workers) or shut down before it started
        transport = {**message.transport, "host": host}
        ending = _serve(message.name, role, message.model, message.llm_options, message.kv_lease_s,
                        message.threads, transport, pull, push, watch.alive, codec)
        if ending == "front end gone":
            print(f"minipd worker: the connection to the front end at {connect} closed and no shutdown came: "
                  "leaving", file=sys.stderr, flush=True)
        return 0 if ending == "shutdown" else 1
    finally:
        watch.close()
        push.close(linger=1000)
        pull.close(linger=0)
        context.term()


def _serve(name: str, role: str, model: str, llm_options: dict, kv_lease_s: float, threads: int | None,
           transport: dict, pull: Any, push: Any, parent_alive: Any, codec: Codec) -> str:
    """Load the engine and the KV transport, say ready, and serve the front end's messages. Returns how it
    ended: ``"shutdown"``, ``"front end gone"`` or ``"failed"`` (reported to the front end)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent and backend at INFO
    from minipd.kernels.cpu_paged_attention import NO_BUILD_ENV

    # Never compile the C++ kernel here: a build takes a minute, and the front end is waiting.
    os.environ.setdefault(NO_BUILD_ENV, "1")
    host = transport.get("host", "127.0.0.1")
    if is_loopback(host):
        # UCX (NIXL's backend) otherwise listens on every interface the machine has.
        os.environ.setdefault("UCX_NET_DEVICES", "lo")

    def send(report: m.Message) -> None:
        # Never a blocking send: with the front end gone, a full outbox would hold the worker for ever.
        send_nowait(push, codec.encode(m.stamped(report, name)), parent_alive, FrontEndGone, "the front end")

    built = None
    try:
        from minipd.engine.factory import build_core
        from minipd.pd.transport import NixlTransport, TorchDistributedTransport

        # (Requests carry their EOS tokens: no tokenizer needed.)
        built = build_core(model, **role_options(role, llm_options))
        core = built.core
        if transport["name"] == "nixl":
            kv = NixlTransport(name, core.pool)
        else:
            kv = TorchDistributedTransport(name, core.pool, transport["rank"], transport["world_size"],
                                           transport["address"], -(-core.max_model_len // core.config.block_size),
                                           transport.get("wire_dtype"), host=host,
                                           store_hosted=transport.get("store_hosted", False))
        send(m.Ready(os.getpid(), kv.peer_info(), core.block_manager.num_blocks, core.kv_spec.to_dict(),
                     {k: str(v) for k, v in core.describe().items()}))
        shut_down = _Worker(role, core, kv, send, kv_lease_s, HEARTBEAT_INTERVAL).serve(pull, parent_alive, codec)
        return "shutdown" if shut_down else "front end gone"
    except FrontEndGone as err:
        if parent_alive():  # not gone: the socket failed (closed under the worker, its context ended)
            print(f"minipd worker {name}: {err}", file=sys.stderr, flush=True)
            return "failed"
        return "front end gone"  # nobody to tell
    except Exception as err:
        # Whatever failed (the model, a transport, an expert-parallel rank), this worker is done: say so
        # and exit, and the front end sends its requests elsewhere.
        with contextlib.suppress(FrontEndGone):
            send(m.Failure(f"{name} failed: {type(err).__name__}: {err}\n{traceback.format_exc()}"))
        return "failed"
    finally:
        if built is not None:
            built.close()


class _Worker:
    """The loop of one worker around its engine core and its KV connector's two sides (separate from
    the process plumbing, for reading)."""

    def __init__(self, role: str, core: Any, transport: Any, send: Any, kv_lease_s: float,
                 heartbeat: float = HEARTBEAT_INTERVAL) -> None:
        from minipd.pd.connector import KVConnectorScheduler, KVConnectorWorker

        self.role, self.core, self.transport = role, core, transport
        self.heartbeat, self.last_sent = heartbeat, time.monotonic()

        def send_and_note(report: m.Message) -> None:
            self.last_sent = time.monotonic()
            send(report)

        self.send = send_and_note
        self.kv_scheduler = KVConnectorScheduler(core, kv_lease_s)
        # Bytes as they travel: the pool's, or fewer when blocks are quantized for the wire only.
        wire_bytes = getattr(transport, "bytes_per_block", core.kv_spec.bytes_per_block)
        self.kv_worker = KVConnectorWorker(transport, core.config.block_size, wire_bytes, core.kv_spec.num_layers,
                                           kv_lease_s)
        core.set_layer_hook(self.on_layer_stored)
        # The step under way: when it started, and each layer's (hook entered, hook left) times; what the
        # prefill of each request that finished in it looked like, for the front end's timelines.
        self.step_start = 0.0
        self.layer_marks: list[tuple[float, float]] = []
        self.timelines: dict[str, dict] = {}
        #: Transfer reports held back on purpose (the "late_reports" fault), with when they are due.
        self.late: list[tuple[float, dict]] = []
        #: Requests aborted while a read into their blocks was under way, with the abort's arguments.
        self.abort_after_load: dict[str, tuple] = {}

    def serve(self, pull: Any, parent_alive: Any, codec: Codec) -> bool:
        """Serve until a ``Shutdown`` (True) or until ``parent_alive()`` says the front end is gone (False)."""
        # The loop's own work between steps (each step's ``overhead_before``): from the previous step's end, or
        # from the last wait for a message that timed out (the loop was idle until then), to the next step's start,
        # less the time blocked waiting for a message since.
        since, blocked = time.perf_counter(), 0.0
        while True:
            sched = self.core.scheduler
            busy = bool(sched.running or sched.waiting)  # something can compute now
            # Transfers under way are watched closely (their end is a request's start of decode); held
            # blocks only need their lease checked.
            if busy:
                timeout_ms = 0
            elif self.kv_worker.loads or self.kv_worker.saves or self.kv_scheduler.watching or self.late:
                timeout_ms = 1
            else:
                timeout_ms = int(POLL_INTERVAL * 1000) if self.kv_scheduler.held_since else 1000
            while True:
                waited_from = time.perf_counter()
                arrived = pull.poll(timeout_ms)
                if timeout_ms:
                    if not arrived:
                        since, blocked = time.perf_counter(), 0.0  # idle until now: nothing came
                    else:
                        blocked += time.perf_counter() - waited_from
                if not arrived:
                    break
                message = receive(pull, codec, 0, "minipd worker")
                if message is not None and not self.handle(message):
                    return True
                timeout_ms = 0
            if not parent_alive():
                return False  # the front end is gone: nobody to serve
            if time.monotonic() - self.last_sent >= self.heartbeat:
                self.send(m.Heartbeat())
            try:
                self.watch_transfers()
            except Exception as err:  # a transport fault must not take the worker (and its requests) down
                self.send(m.Notice(f"{type(err).__name__}: {err}"))
            if self.core.has_unfinished_requests():
                self.step_start, self.layer_marks = time.perf_counter(), []
                steps = self.core.num_steps
                outputs = self.core.step()
                # The step's record goes to the front end with its outputs (metrics, a fitted step-time model).
                stats = [self.core.step_stats[-1]] if self.core.num_steps != steps and self.core.step_stats else []
                if stats:
                    overhead = max(0.0, stats[0].start_time - since - blocked)
                    stats = [dataclasses.replace(stats[0], overhead_before=overhead)]
                    since, blocked = stats[0].start_time + stats[0].duration, 0.0
                self.report(outputs, time.perf_counter(), stats)
                failure = self.core.take_failure()  # (after its step's tokens went out: nothing is lost)
                if failure is not None:
                    self.send(m.Notice(f"{type(failure).__name__}: {failure}"))

    def handle(self, message: Any) -> bool:
        from minipd.engine.request import EngineCoreOutputs

        if not isinstance(message, m.Message):
            self.send(m.Notice(f"ignored a message that is not a command: {message!r:.200}"))
            return True
        kv = self.kv_scheduler
        try:
            if isinstance(message, m.AddRequest):
                self.core.add_request(message.request)
            elif isinstance(message, m.AddRemote):  # pull
                kv.add_remote(message.request, message.peer, message.blocks)
            elif isinstance(message, m.AddPush):  # push modes
                self.core.add_request(message.request)
                self.kv_worker.add_save(message.request.request_id, message.peer, message.blocks, message.layerwise)
            elif isinstance(message, m.Abort):
                now = []
                for request_id in message.request_ids:
                    pending = kv.pending_loads.get(request_id)
                    if pending is not None:  # its read never started: the holder may free its blocks now
                        self.kv_worker.notify(pending.peer, request_id)
                    kv.cancel(request_id)
                    if request_id in self.kv_worker.loads:
                        # A read is landing in its blocks: free them once it has landed or failed, never
                        # before (they could be given to another request while the bytes still arrive).
                        self.abort_after_load[request_id] = (message.reason,)
                    else:
                        now.append(request_id)
                self.report(EngineCoreOutputs(self.core.abort_requests(now, message.reason), time.perf_counter()))
            elif isinstance(message, m.ReleaseKV):  # the request ended at its first token: nobody will read
                if not kv.release(message.request_id):
                    self.core.release_kv(message.request_id)
            elif isinstance(message, m.Reserve):
                self.send(m.Reserved(message.request_id, kv.reserve(message.request_id, message.num_tokens)))
            elif isinstance(message, m.Adopt):
                kv.add_adopted(message.request)
                self.admit_filled()
            elif isinstance(message, m.ReleaseReservation):
                kv.release_reservation(message.request_id, message.after_writes)
            elif isinstance(message, m.AddPeer):
                self.transport.add_peer(message.peer)
            elif isinstance(message, m.InjectFault):
                self.kv_worker.faults.add(message.fault)
                if message.fault == "slow_writes":
                    self.transport.store_delay_s = 0.02
            elif isinstance(message, m.AskStats):
                bm = self.core.block_manager
                self.send(m.Stats(bm.num_used_blocks, bm.num_free_blocks, len(self.core.requests)))
            elif isinstance(message, m.Shutdown):
                return False
            else:
                self.send(m.Notice(f"ignored a message that is not for a worker: {type(message).__name__}"))
        except Exception as err:  # a bad message must not take the worker down
            request = getattr(message, "request", None)
            if request is None:  # not about one request: the worker goes on (a Failure says it cannot)
                self.send(m.Notice(f"{type(message).__name__} failed: {type(err).__name__}: {err}"))
            else:
                self.send(m.Failure(f"{type(err).__name__}: {err}", request.request_id))
        return True

    def on_layer_stored(self, batch: Any, layer: int) -> None:
        """Note when this layer finished; layer-wise, post its blocks of the step's saves."""
        entered = time.perf_counter()
        self.kv_worker.save_kv_layer(batch, layer)
        self.layer_marks.append((entered, time.perf_counter()))

    def report(self, outputs: Any, step_end: float | None = None, stats: list | None = None) -> None:
        """Send the front end a step's (or an abort's) outputs and record, with the blocks of prefills that
        hold their K/V."""
        from minipd.engine.request import RequestStatus

        held, timelines = {}, {}
        timeline = None
        saves = self.kv_worker.saves
        for out in outputs.outputs:
            request = self.core.requests.get(out.request_id)
            if request is None or request.status is not RequestStatus.FINISHED_HOLDING_KV:
                continue
            if step_end is not None:  # this step finished the prefill: how its layers went (once per step)
                timeline = timeline or self.step_timeline(step_end)
                if out.request_id in saves:
                    self.timelines[out.request_id] = timeline  # sent with the save's completion
                else:
                    timelines[out.request_id] = timeline
            if out.request_id in saves:  # saved K/V are freed here once written
                self.kv_worker.prefill_done(out.request_id, list(request.blocks.block_table))
            else:
                held[out.request_id] = list(request.blocks.block_table)
                self.kv_scheduler.hold(out.request_id)
        if outputs.outputs or held or stats:
            self.send(m.Outputs(outputs, held, timelines, self.core.block_manager.num_free_blocks, stats or []))

    def step_timeline(self, step_end: float) -> dict:
        """The step just taken: its bounds, and each layer's compute (from the previous hook's return to
        this layer's hook)."""
        starts = [self.step_start] + [end for _, end in self.layer_marks[:-1]]
        return {"prefill_step": (self.step_start, step_end),
                "layers": [(a, b) for a, (b, _) in zip(starts, self.layer_marks, strict=True)]}

    def admit_filled(self) -> None:
        for request_id, why in self.kv_scheduler.admit_filled().items():
            self.send(m.KVFailed(request_id, why))

    def watch_transfers(self) -> None:
        """Start the loads whose blocks are ready; act on every transfer that ended and every lease that ran out."""
        from minipd.engine.request import EngineCoreOutputs

        kv, mover = self.kv_scheduler, self.kv_worker
        for request_id in [r for r in mover.saves if r not in self.core.requests]:
            mover.abort_save(request_id)
            self.timelines.pop(request_id, None)
        ready, unneeded = kv.loads_ready()
        for request_id, load in unneeded.items():  # the local prefix cache had the prompt: the sender may free
            mover.notify(load.peer, request_id)
        for request_id, (load, local_blocks) in ready.items():
            try:
                mover.start_load_kv(request_id, load, list(local_blocks))
            except Exception as err:
                self._fail_load(request_id, f"{type(err).__name__}: {err}")
        finished = mover.get_finished()
        for request_id, given_up in finished.notes:
            # Prefill side: a reader is done with our blocks. Decode side: a writer is done with a reservation.
            if not (not given_up and kv.release(request_id)):
                kv.on_written(request_id, given_up)
        self.admit_filled()
        for request_id in kv.expire():
            self.send(m.KVFailed(request_id, "reservation expired"))
        for request_id, (num_bytes, start, end) in finished.done_recving.items():
            if request_id in self.abort_after_load:
                reason = self.abort_after_load.pop(request_id)
                self.report(EngineCoreOutputs(self.core.abort_requests([request_id], *reason), time.perf_counter()))
            elif request_id in self.core.requests:
                self.core.finish_kv_load(request_id)
                self.send(m.KVLoaded(request_id, num_bytes, start, end))
        for request_id, why in finished.failed_recving.items():
            self._fail_load(request_id, why)
        for request_id, save in finished.done_sending.items():
            self.core.release_kv(request_id)
            timeline = self.timelines.pop(request_id, {})
            report = m.KVLoaded(request_id, save.num_bytes, save.started, time.perf_counter(), save.compute_end,
                                {**timeline, "sends": save.sends})
            if "late_reports" in mover.faults:  # reach the front end well after the decode worker's outputs
                self.late.append((time.monotonic() + 0.3, report))
            else:
                self.send(report)
        due = [report for when, report in self.late if when <= time.monotonic()]
        self.late = [(when, report) for when, report in self.late if when > time.monotonic()]
        for report in due:
            self.send(report)
        for request_id, why in finished.failed_sending.items():
            self.core.release_kv(request_id)
            self.timelines.pop(request_id, None)
            self.send(m.KVFailed(request_id, why))

    def _fail_load(self, request_id: str, why: str) -> None:
        """A read that failed or outlived its lease: drop the request here; the front end recomputes it."""
        from minipd.engine.request import FinishReason

        self.kv_worker.cancel_load(request_id)
        self.abort_after_load.pop(request_id, None)
        self.core.abort_requests([request_id], FinishReason.ABORT)
        self.send(m.KVFailed(request_id, why))
