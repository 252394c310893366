"""A prefill or decode worker: one process, one engine core with its own KV pool, one KV transport.

The worker serves messages from the front end (:class:`~minipd.pd.llm.DisaggregatedLLM`) over ZeroMQ
and steps its core while it has work:

- a **prefill** worker runs requests up to their first token and keeps their blocks
  (``hold_kv``); it tells the front end which blocks hold each request's K/V, and frees them when the
  decode worker's read is done (a NIXL notification) or when the lease runs out;
- a **decode** worker admits a request whose prompt K/V are elsewhere (``num_external_tokens``),
  reads them from the prefill worker's blocks into its own once they are allocated, and decodes.

Messages in: ("add", Request), ("add_remote", Request, peer name, peer block ids), ("abort", ids,
reason), ("release_kv", id), ("add_peer", info), ("stats",), ("fault", name), ("shutdown",). Messages out are dicts
with a ``kind``: ready, outputs, kv_loaded, kv_failed, stats, error.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
from dataclasses import dataclass
from typing import Any

#: How long the loop waits for a message when transfers or leases need watching.
POLL_INTERVAL = 0.005
#: The handle of a read lost on purpose (fault injection).
_LOST = object()


@dataclass
class _Push:
    """A prefill-side request whose K/V this worker writes into a decode worker's reserved blocks."""

    peer: str
    remote_blocks: list[int]
    layerwise: bool
    next_block: int = 0  # first block not yet written in full (layer-wise)
    handles: list = None  # type: ignore[assignment]
    started: float = 0.0
    num_bytes: int = 0
    prefilled: bool = False
    failed: bool = False
    aborted: bool = False  # the request was aborted here: finish the writes under way, then tell the reader
    compute_end: float = 0.0  # when the step that finished the prefill ended
    sends: list = None  # type: ignore[assignment]  # (layer or None, post start, post end) of each write

    def __post_init__(self) -> None:
        self.handles, self.sends = [], []


@dataclass
class _RemoteLoad:
    """A decode-side request whose prompt K/V are read from a prefill worker."""

    peer: str
    remote_blocks: list[int]
    handle: Any = None
    started: float = 0.0
    num_bytes: int = 0


#: Launched workers (``python -m minipd worker``) report at least this often, so the front end can tell
#: a silent worker from a dead one.
HEARTBEAT_INTERVAL = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (for torch.distributed's rendezvous)."""
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def run_worker(role: str, index: int, model: str, llm_options: dict, inbox: str, outbox: str,
               kv_lease_s: float, threads: int | None, transport: dict) -> None:
    """Entry point of a worker process spawned by the front end (it ends when its parent does)."""
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(inbox)
    push = context.socket(zmq.PUSH)
    push.connect(outbox)
    parent = os.getppid()
    try:
        _serve(f"{role}{index}", role, model, llm_options, kv_lease_s, threads, transport, pull, push,
               lambda: os.getppid() == parent, heartbeat=None)
    finally:
        push.close(linger=1000)
        pull.close(linger=0)
        context.term()


def run_launched_worker(connect: str, role: str | None = None, host: str = "127.0.0.1",
                        num_prefill_workers: int = 1, join_timeout: float = 300.0) -> int:
    """Entry point of ``python -m minipd worker``: a worker started by hand (or by ``torchrun``), on this
    machine or another, that joins a front end listening at ``connect``.

    It binds its own inbox on ``host`` (the address the front end reaches it at), says hello with its
    role, and receives from the front end everything else: the model, engine options, its name and
    the KV transport. Under ``torchrun`` the role may be left out: ranks below ``num_prefill_workers``
    prefill, the others decode, and the ``torch`` transport uses torchrun's rendezvous. It serves
    until the front end shuts it down (or it is killed). Returns the exit status.
    """
    import zmq

    rank = os.environ.get("RANK")
    if role is None:
        if rank is None:
            raise ValueError("role must be 'prefill' or 'decode' (or leave it out under torchrun, which sets RANK)")
        role = "prefill" if int(rank) < num_prefill_workers else "decode"
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(connect)
    pull = context.socket(zmq.PULL)
    pull.bind(f"tcp://{host}:*")
    try:
        hello = {"kind": "hello", "role": role, "inbox": pull.getsockopt_string(zmq.LAST_ENDPOINT), "host": host,
                 "free_port": free_port(host), "pid": os.getpid(),  # in case it hosts torch.distributed's store
                 "torchrun": None if rank is None else (int(rank), int(os.environ.get("WORLD_SIZE", "1")))}
        push.send(pickle.dumps(hello, protocol=pickle.HIGHEST_PROTOCOL))
        if not pull.poll(int(join_timeout * 1000)):
            raise TimeoutError(f"no front end answered at {connect} within {join_timeout:.0f} s")
        message = pickle.loads(pull.recv())
        if message[0] != "config":
            return 0  # refused (the front end has enough workers) or shut down before it started
        _, name, model, llm_options, kv_lease_s, threads, transport = message
        _serve(name, role, model, llm_options, kv_lease_s, threads, transport, pull, push, lambda: True,
               heartbeat=HEARTBEAT_INTERVAL)
        return 0
    finally:
        push.close(linger=1000)
        pull.close(linger=0)
        context.term()


def _serve(name: str, role: str, model: str, llm_options: dict, kv_lease_s: float, threads: int | None,
           transport: dict, pull: Any, push: Any, parent_alive: Any, heartbeat: float | None) -> None:
    """Load the engine and the KV transport, say ready, and serve the front end's messages."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent and backend at INFO

    def send(message: dict) -> None:
        message["worker"] = name
        push.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from minipd.llm import LLM
        from minipd.pd.transport import NixlTransport, TorchDistributedTransport

        llm = LLM(model, **llm_options)
        core = llm.engine.core
        if transport["name"] == "nixl":
            kv = NixlTransport(name, core.pool)
        else:
            kv = TorchDistributedTransport(name, core.pool, transport["rank"], transport["world_size"],
                                           transport["address"], -(-core.max_model_len // core.config.block_size))
        send({"kind": "ready", "pid": os.getpid(), "peer": kv.peer_info(),
              "num_kv_blocks": core.block_manager.num_blocks, "kv_spec": core.kv_spec.to_dict()})
        _Worker(role, core, kv, send, kv_lease_s, heartbeat).serve(pull, parent_alive)
    except Exception as err:
        send({"kind": "error", "message": f"{name} failed: {type(err).__name__}: {err}\n{traceback.format_exc()}"})


class _Worker:
    """The loop of one worker around its engine core (separate from the process plumbing, for reading)."""

    def __init__(self, role: str, core: Any, transport: Any, send: Any, kv_lease_s: float,
                 heartbeat: float | None = None) -> None:
        self.role, self.core, self.transport, self.kv_lease_s = role, core, transport, kv_lease_s
        self.heartbeat, self.last_sent = heartbeat, time.monotonic()

        def send_and_note(message: dict) -> None:
            self.last_sent = time.monotonic()
            send(message)

        self.send = send_and_note
        self.remote: dict[str, _RemoteLoad] = {}  # decode side: loads by request id
        #: Faults injected on purpose (tests, the chapter): "lose_reads" makes every read vanish in flight.
        self.faults: set[str] = set()
        self.pushes: dict[str, _Push] = {}  # prefill side, push modes: writes by request id
        self.reserved_at: dict[str, float] = {}  # decode side, push modes: reservations by request id
        self.pushed: set[str] = set()  # decode side: reservations whose K/V have all been written
        #: Decode side: reservations whose writer gave up, and reservations the front end let go of while
        #: writes into them may still be under way (freed when the writer says its writes are over, so a
        #: late write never lands in blocks given to another request).
        self.abandoned: set[str] = set()
        self.releasing: set[str] = set()
        self.adopt: dict[str, Any] = {}  # decode side: requests waiting for their K/V to be written
        core.runner.layer_hook = self.on_layer_stored
        self.held_since: dict[str, float] = {}  # prefill side: when each request's K/V started waiting
        # The step under way: when it started, and each layer's (hook entered, hook left) times; what the
        # prefill of each request that finished in it looked like, for the front end's timelines.
        self.step_start = 0.0
        self.layer_marks: list[tuple[float, float]] = []
        self.timelines: dict[str, dict] = {}

    def serve(self, pull: Any, parent_alive: Any) -> None:
        while True:
            sched = self.core.scheduler
            busy = bool(sched.running or sched.waiting)  # something can compute now
            # Reads under way are watched closely (their end is a request's start of decode); held
            # blocks only need their lease checked.
            if busy:
                timeout_ms = 0
            elif self.remote or self.pushes or self.reserved_at:
                timeout_ms = 1
            else:
                timeout_ms = int(POLL_INTERVAL * 1000) if self.held_since else 1000
            while pull.poll(timeout_ms):
                if not self.handle(pickle.loads(pull.recv())):
                    return
                timeout_ms = 0
            if not parent_alive():
                return  # the front end is gone: nobody to serve
            if self.heartbeat is not None and time.monotonic() - self.last_sent >= self.heartbeat:
                self.send({"kind": "heartbeat"})
            try:
                self.watch_transfers()
            except Exception as err:  # a transport fault must not take the worker (and its requests) down
                self.send({"kind": "warning", "message": f"{type(err).__name__}: {err}"})
            if self.core.has_unfinished_requests():
                self.step_start, self.layer_marks = time.perf_counter(), []
                outputs = self.core.step()
                self.report(outputs, time.perf_counter())

    def handle(self, message: tuple) -> bool:
        from minipd.engine.request import EngineCoreOutputs

        kind = message[0]
        try:
            if kind == "add":
                self.core.add_request(message[1])
            elif kind == "add_remote":
                request, peer, blocks = message[1:]
                self.core.add_request(request)
                self.remote[request.request_id] = _RemoteLoad(peer, list(blocks))
            elif kind == "abort":
                for request_id in message[1]:
                    self.remote.pop(request_id, None)
                    self.held_since.pop(request_id, None)
                self.report(EngineCoreOutputs(self.core.abort_requests(message[1], *message[2:]), time.perf_counter()))
            elif kind == "release_kv":
                self.held_since.pop(message[1], None)
                self.core.release_kv(message[1])
            elif kind == "add_peer":
                self.transport.add_peer(message[1])
            elif kind == "fault":
                self.faults.add(message[1])
                if message[1] == "slow_writes":
                    self.transport.store_delay_s = 0.02
            elif kind == "add_push":
                request, peer, blocks, layerwise = message[1:]
                self.core.add_request(request)
                self.pushes[request.request_id] = _Push(peer, list(blocks), layerwise)
            elif kind == "reserve":
                blocks = self.core.reserve_blocks(message[1], message[2])
                if blocks is not None:
                    self.reserved_at[message[1]] = time.monotonic()
                self.send({"kind": "reserved", "request_id": message[1], "blocks": blocks})
            elif kind == "adopt":
                self.adopt[message[1].request_id] = message[1]
                self.adopt_arrived()
            elif kind == "release_reservation":
                request_id, writes_started = message[1], message[2]
                if writes_started and request_id in self.reserved_at and \
                        not (request_id in self.pushed or request_id in self.abandoned):
                    self.releasing.add(request_id)
                else:
                    self.drop_reservation(request_id)
            elif kind == "stats":
                bm = self.core.block_manager
                self.send({"kind": "stats", "used_blocks": bm.num_used_blocks, "free_blocks": bm.num_free_blocks,
                           "live_requests": len(self.core.requests)})
            elif kind == "shutdown":
                return False
        except Exception as err:  # a bad message must not take the worker down
            request_id = message[1].request_id if kind in ("add", "add_remote") else None
            self.send({"kind": "error", "request_id": request_id, "message": f"{type(err).__name__}: {err}"})
        return True

    # ------------------------------------------------------------------ push and layer-wise transfers
    def on_layer_stored(self, batch: Any, layer: int) -> None:
        """Note when this layer finished; layer-wise, write its blocks of the step's pushed requests."""
        entered = time.perf_counter()
        if self.pushes:
            self.push_layer(batch, layer)
        self.layer_marks.append((entered, time.perf_counter()))

    def push_layer(self, batch: Any, layer: int) -> None:
        """Write this layer's blocks of the step's layer-wise pushed requests while the next layer computes."""
        bs = self.core.config.block_size
        last_layer = layer == self.core.kv_spec.num_layers - 1
        for request, n in batch.entries:
            push = self.pushes.get(request.request_id)
            if push is None or not push.layerwise:
                continue
            # Blocks this step touched, and any before them not yet sent (a prefix-cache hit's blocks).
            end = min(-(-(request.num_computed_tokens + n) // bs), len(push.remote_blocks))
            table = request.blocks.block_table
            if end > push.next_block and not push.failed:
                posted = time.perf_counter()
                push.started = push.started or posted
                try:  # a failed write must not fail the forward pass of every other request
                    push.handles.append(self.transport.start_write(push.peer, table[push.next_block:end],
                                                                   push.remote_blocks[push.next_block:end], [layer]))
                except Exception:
                    push.failed = True
                    continue
                push.sends.append((layer, posted, time.perf_counter()))
                push.num_bytes += (end - push.next_block) * self.core.kv_spec.bytes_per_block // \
                    self.core.kv_spec.num_layers
            if last_layer:  # the partly filled last block is written again with the next chunk
                push.next_block = (request.num_computed_tokens + n) // bs

    def watch_pushes(self) -> None:
        from minipd.engine.request import RequestStatus

        for request_id, push in list(self.pushes.items()):
            request = self.core.requests.get(request_id)
            if request is None and not push.aborted:
                push.aborted = True
                self.timelines.pop(request_id, None)
            if not push.prefilled and not push.aborted:
                if request.status is not RequestStatus.FINISHED_HOLDING_KV:
                    continue
                push.prefilled = True
                push.compute_end = time.perf_counter()
                if not push.layerwise:  # the whole prompt, all layers, in one transfer after the step
                    n = min(len(request.blocks.block_table), len(push.remote_blocks))
                    push.started = time.perf_counter()
                    try:
                        push.handles.append(self.transport.start_write(push.peer, request.blocks.block_table[:n],
                                                                       push.remote_blocks[:n]))
                    except Exception:
                        push.failed = True
                    push.sends.append((None, push.started, time.perf_counter()))
                    push.num_bytes = n * self.core.kv_spec.bytes_per_block
            states = [self.transport.poll(h) for h in push.handles]  # "ERR" when the reader is gone
            push.handles = [h for h, st in zip(push.handles, states, strict=True) if st == "PROC"]
            expired = time.perf_counter() - (push.started or time.perf_counter()) > self.kv_lease_s
            failed = push.failed or "ERR" in states or expired
            if failed or not push.handles:
                del self.pushes[request_id]
                timeline = self.timelines.pop(request_id, {})
                self.held_since.pop(request_id, None)
                if failed or push.aborted:
                    # "!": no more writes will come, and what was written must not be used.
                    with contextlib.suppress(Exception):  # a reader that is gone needs no word
                        self.transport.notify(push.peer, b"!" + request_id.encode())
                    if push.aborted:
                        continue
                self.core.release_kv(request_id)
                if failed:
                    self.send({"kind": "kv_failed", "request_id": request_id, "message": "push failed"})
                else:
                    try:
                        self.transport.notify(push.peer, request_id.encode())
                    except Exception:  # the reader is gone: the front end recomputes the request
                        self.send({"kind": "kv_failed", "request_id": request_id, "message": "reader gone"})
                        continue
                    self.send({"kind": "kv_loaded", "request_id": request_id, "bytes": push.num_bytes,
                               "start": push.started, "end": time.perf_counter(), "compute_end": push.compute_end,
                               "timeline": {**timeline, "sends": push.sends}})

    def adopt_arrived(self) -> None:
        """Decode side: admit each request whose K/V have all been written into its reservation."""
        for request_id in [r for r in self.adopt if r in self.pushed]:
            self.pushed.discard(request_id)
            self.reserved_at.pop(request_id, None)
            try:
                self.core.add_reserved(self.adopt.pop(request_id), request_id)
            except ValueError as err:
                self.core.release_reservation(request_id)
                self.send({"kind": "kv_failed", "request_id": request_id, "message": str(err)})

    def drop_reservation(self, request_id: str) -> None:
        self.reserved_at.pop(request_id, None)
        self.pushed.discard(request_id)
        self.abandoned.discard(request_id)
        self.releasing.discard(request_id)
        self.adopt.pop(request_id, None)
        self.core.release_reservation(request_id)

    def report(self, outputs: Any, step_end: float | None = None) -> None:
        """Send the front end a step's (or an abort's) outputs, with the blocks of prefills that hold their K/V."""
        from minipd.engine.request import RequestStatus

        held, timelines = {}, {}
        timeline = None
        for out in outputs.outputs:
            request = self.core.requests.get(out.request_id)
            if request is None or request.status is not RequestStatus.FINISHED_HOLDING_KV:
                continue
            if step_end is not None:  # this step finished the prefill: how its layers went (once per step)
                timeline = timeline or self.step_timeline(step_end)
                if out.request_id in self.pushes:
                    self.timelines[out.request_id] = timeline  # sent with the push's completion
                else:
                    timelines[out.request_id] = timeline
            if out.request_id not in self.pushes:  # pushed K/V are freed here once written
                held[out.request_id] = list(request.blocks.block_table)
                self.held_since[out.request_id] = time.monotonic()
        if outputs.outputs or held:
            self.send({"kind": "outputs", "outputs": outputs, "held": held, "timelines": timelines,
                       "free_blocks": self.core.block_manager.num_free_blocks})

    def step_timeline(self, step_end: float) -> dict:
        """The step just taken: its bounds, and each layer's compute (from the previous hook's return to
        this layer's hook)."""
        starts = [self.step_start] + [end for _, end in self.layer_marks[:-1]]
        return {"prefill_step": (self.step_start, step_end),
                "layers": [(a, b) for a, (b, _) in zip(starts, self.layer_marks, strict=True)]}

    def watch_transfers(self) -> None:
        from minipd.engine.request import FinishReason, RequestStatus

        now = time.monotonic()
        self.watch_pushes()
        # Prefill side (pull): a finished read frees the blocks at once; an expired lease frees them anyway.
        # Decode side (push): the writer's notification says a reservation is filled.
        for message in self.transport.notifications():
            given_up = message.startswith(b"!")
            request_id = message[1:].decode() if given_up else message.decode()
            if not given_up and self.held_since.pop(request_id, None) is not None:
                self.core.release_kv(request_id)
            elif request_id in self.releasing:  # the front end let go of it; now no write can land
                self.drop_reservation(request_id)
            elif request_id in self.reserved_at:
                (self.abandoned if given_up else self.pushed).add(request_id)
        self.adopt_arrived()
        for request_id, since in list(self.reserved_at.items()):
            if now - since > self.kv_lease_s and request_id not in self.pushed:
                self.drop_reservation(request_id)
                self.send({"kind": "kv_failed", "request_id": request_id, "message": "reservation expired"})
        for request_id, since in list(self.held_since.items()):
            if now - since > self.kv_lease_s:
                del self.held_since[request_id]
                self.core.release_kv(request_id)
        # Decode side: start reads for requests whose blocks are now allocated, and finish the done ones.
        for request_id, load in list(self.remote.items()):
            request = self.core.requests.get(request_id)
            if request is None:
                del self.remote[request_id]
                continue
            if load.handle is None:
                if request.status is RequestStatus.RUNNING:
                    # The local prefix cache already had the prompt: nothing to read; the sender may free its copy.
                    del self.remote[request_id]
                    with contextlib.suppress(Exception):  # a sender that is gone frees by its lease
                        self.transport.notify(load.peer, request_id.encode())
                    continue
                if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
                    continue
                n = -(-request.num_external_tokens // self.core.config.block_size)
                if "lose_reads" in self.faults:  # the read is started, and never heard of again
                    load.handle, load.started = _LOST, time.perf_counter()
                    continue
                try:
                    load.handle = self.transport.start_read(load.peer, load.remote_blocks[:n],
                                                            request.blocks.block_table[:n], request_id.encode())
                except Exception as err:
                    self._fail(request_id, f"{type(err).__name__}: {err}", FinishReason, now)
                    continue
                load.started, load.num_bytes = time.perf_counter(), n * self.core.kv_spec.bytes_per_block
                continue
            state = "PROC" if load.handle is _LOST else self.transport.poll(load.handle)
            if state == "DONE":
                del self.remote[request_id]
                self.core.finish_kv_load(request_id)
                self.send({"kind": "kv_loaded", "request_id": request_id, "bytes": load.num_bytes,
                           "start": load.started, "end": time.perf_counter()})
            elif state == "ERR" or time.perf_counter() - load.started > self.kv_lease_s:
                self._fail(request_id, f"transfer {state.lower()} after {time.perf_counter() - load.started:.1f} s",
                           FinishReason, now)

    def _fail(self, request_id: str, why: str, reasons: Any, now: float) -> None:
        """A read that failed or outlived its lease: drop the request here; the front end recomputes it."""
        self.remote.pop(request_id, None)
        self.core.abort_requests([request_id], reasons.ABORT)
        self.send({"kind": "kv_failed", "request_id": request_id, "message": why})
