"""``DisaggregatedLLM``: prefill and decode in separate worker processes, with the K/V moved between them.

The front end (this process) tokenises, routes and detokenises; the workers
(:mod:`minipd.pd.worker`) each own an engine core and a KV pool. A request's life:

1. it goes to the prefill worker with the fewest requests in flight, which computes the prompt,
   samples the first token (with the request's own seed, token index 0) and keeps the prompt's
   blocks;
2. unless that token ends it, it goes on to the decode worker with the most free KV blocks, as a
   request whose prompt K/V are elsewhere. With ``kv_transfer="layerwise"`` (the default) the decode
   worker reserved blocks before the prefill started and the prefill worker wrote each layer's K/V
   into them as soon as that layer stored them, while the next layer computed; with ``"push"`` it
   writes them all once the prefill is done; with ``"pull"`` the decode worker allocates blocks after
   the prefill and reads the prefill worker's blocks into them. The prefill worker frees its copy as
   soon as the transfer is done (over NIXL, or ``torch.distributed`` where NIXL is missing);
3. the decode worker samples every later token (token index 1 on), so the outputs are the ones a
   single engine gives, greedy or seeded.

If a worker dies, the front end notices within a poll and sends its unfinished requests elsewhere,
recomputed from the prompt and the tokens already produced (seeded sampling depends only on the
seed and the token index, so the continuation is the same); with no decode worker left, a prefill
worker decodes, and with no prefill worker left a decode worker prefills. A worker that stops
answering (stopped, wedged) is treated the same way once it has been silent for
``heartbeat_timeout``, and fenced: a worker this front end started is killed, a launched one is
told to leave and nothing it says is heard again. A worker whose engine fails (an expert-parallel
rank died under it, say) reports it and exits, and is recovered from like any other death.
A transfer that never completes is bounded by ``kv_lease_s`` on both sides.

Messages between the front end and the workers are typed and signed (:mod:`minipd.wire`); nothing
received is unpickled, and every socket is on 127.0.0.1 unless ``listen`` names another address.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from minipd.config import ModelConfig
from minipd.engine.config import EngineConfig
from minipd.engine.inputs import PromptInput, encode_prompt, normalize_params, normalize_prompts
from minipd.engine.output_processor import OutputProcessor, RequestState
from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, Request
from minipd.engine.step_core import check_fits_pool
from minipd.errors import ParameterError
from minipd.kv.quant import PER_TOKEN_FORMATS
from minipd.models.registry import resolve_model
from minipd.outputs import KVTimeline, RequestOutput, RequestStream, StreamDelta
from minipd.pd.transport import TRANSPORTS, nixl_available
from minipd.pd.worker import free_port, run_worker
from minipd.sampling_params import SamplingParams, check_seed
from minipd.tokenizer import Tokenizer
from minipd.wire import Codec, cluster_secret, new_key, receive, send_nowait

KV_TRANSFERS = ("pull", "push", "layerwise")
logger = logging.getLogger("minipd")


class WorkerError(RuntimeError):
    """A worker failed to start, or every worker of a role is gone and the request cannot go on."""


@dataclass
class _Worker:
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


@dataclass
class _Flight:
    """A request in flight: where it is and what it needs to be resumed elsewhere."""

    state: RequestState
    request: Request
    worker: str = ""
    phase: str = "prefill"  # ("reserving", then) "prefill", then "decode"
    prefill_tokens: int = 0
    cached_tokens: int = 0
    #: Push modes: the decode worker whose reserved blocks receive the prompt's K/V, and whether they have.
    dest: str = ""
    kv_done: bool = False
    mode: str = "pull"  # the kv_transfer in force when the request arrived
    held_back: bool = False  # it has waited in the backlog for decode room at least once
    #: Push modes: the final output, kept until the prefill worker's word on the transfer arrives (it
    #: comes on another socket than the decode worker's outputs), so the metrics are complete.
    parked: tuple[EngineCoreOutput, float, float] | None = None  # the output, its timestamp, when parked


class DisaggregatedLLM:
    """Prefill and decode workers in separate processes, in :class:`~minipd.llm.LLM`'s shape.

    Args:
        model: a bundled name, a local HF folder or a hub id, as for ``LLM``.
        num_prefill_workers, num_decode_workers: how many of each (at least one prefill worker).
        kv_transfer: how K/V move: ``"pull"`` (the decode worker reads the prefill worker's blocks after
            the prefill), ``"push"`` (the prefill worker writes them into blocks the decode worker reserved
            first) or ``"layerwise"`` (pushed layer by layer while the prefill computes). It can be changed
            between requests (``llm.kv_transfer = "push"``); it applies to requests submitted afterwards.
        kv_transport: what moves them: ``"nixl"`` (the default where installed) or ``"torch"``
            (``torch.distributed`` with gloo: every platform, slower, no recovery of transfers under way
            when a worker dies — those requests are recomputed after ``kv_lease_s``).
        kv_transfer_dtype: quantize K/V for the wire only: ``"int8"``, ``"fp8"`` or ``"int4_per_token"``
            (None: as the pool stores them). Both pools keep floats; the bytes moved shrink as a quantized
            pool's would, and the decode worker reads the prompt's K/V rounded to the format. Needs
            ``kv_transport="torch"`` and a float ``kv_cache_dtype``.
        kv_lease_s: how long a prefill worker keeps a finished request's blocks for a reader, and how
            long a read may take before the request is recomputed instead.
        threads_per_worker: torch threads in each worker (default 1: workers share the machine's cores).
        seed: seeds the draw of seeds for requests that give none.
        start_timeout: seconds to wait for the workers to load the model (and, with ``listen``, to join).
        listen: start no processes; instead bind this ZeroMQ address (``"tcp://127.0.0.1:5557"``, or an
            address of another interface for workers on other machines) and wait for workers launched by
            hand or by ``torchrun`` with ``python -m minipd worker --role prefill --connect
            tcp://FRONT-END-HOST:5557``. The model argument is sent to them as given, so it must name the
            same model on their machines. Every message is signed with the cluster secret (``secret``).
        secret: with ``listen``, the key every message is signed with: the secret itself (``str`` or
            ``bytes``, at least 16 bytes) or a ``pathlib.Path`` to a file holding it; by default
            ``MINIPD_CLUSTER_SECRET``, else the file ``MINIPD_CLUSTER_SECRET_FILE``, else
            ``~/.config/minipd/cluster-secret`` (created, readable by this user only, when missing).
            Workers on other machines need the same secret. Spawned workers get a fresh random key instead.
        heartbeat_timeout: a worker silent this long is taken for dead and fenced (it reports at least
            every second while idle; a step longer than this looks like a death).
        **llm_options: passed to each worker's ``LLM`` (``max_model_len``, ``device``, engine options).
    """

    def __init__(self, model: str | os.PathLike = "tiny-py", *, num_prefill_workers: int = 1,
                 num_decode_workers: int = 1, kv_transfer: str = "layerwise", kv_transport: str | None = None,
                 kv_transfer_dtype: str | None = None, kv_lease_s: float = 30.0,
                 threads_per_worker: int | None = 1, seed: int | None = None, start_timeout: float = 180.0,
                 listen: str | None = None, heartbeat_timeout: float = 10.0,
                 secret: str | bytes | os.PathLike | None = None, **llm_options: Any) -> None:
        self._closed = True  # until the workers are up: shutdown() and __del__ have nothing to do
        for name, value, least in (("num_prefill_workers", num_prefill_workers, 1),
                                   ("num_decode_workers", num_decode_workers, 0),
                                   ("threads_per_worker", 1 if threads_per_worker is None else threads_per_worker, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ParameterError(name, f"{name} must be an integer >= {least}"
                                           f"{' (or None)' if name == 'threads_per_worker' else ''}, got {value!r}")
        for name, value, least in (("kv_lease_s", kv_lease_s, 0), ("start_timeout", start_timeout, 0),
                                   ("heartbeat_timeout", heartbeat_timeout, 1)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > least:
                raise ParameterError(name, f"{name} must be a number of seconds > {least}, got {value!r}")
        seed = check_seed("seed", seed)
        self._lease_s = float(kv_lease_s)
        self._heartbeat_timeout = float(heartbeat_timeout)
        if kv_transport is None:
            kv_transport = "nixl" if nixl_available() is None else "torch"
        if kv_transport not in TRANSPORTS:
            raise ParameterError("kv_transport",
                                 f"kv_transport must be one of {', '.join(map(repr, TRANSPORTS))}, "
                                 f"got {kv_transport!r}")
        if kv_transport == "nixl" and nixl_available() is not None:
            raise ParameterError("kv_transport",
                                 f"kv_transport='nixl' is not available here: {nixl_available()}; use 'torch'")
        self.kv_transport = kv_transport
        self.kv_transfer = kv_transfer
        if kv_transfer_dtype is not None:
            if kv_transfer_dtype not in PER_TOKEN_FORMATS:
                raise ParameterError("kv_transfer_dtype",
                                     "kv_transfer_dtype must be None or one of "
                                     f"{', '.join(map(repr, PER_TOKEN_FORMATS))}, got {kv_transfer_dtype!r}")
            if kv_transport != "torch":
                raise ParameterError("kv_transfer_dtype",
                                     "kv_transfer_dtype needs kv_transport='torch': NIXL moves pool memory as it lies, "
                                     "so a compressed wire needs a quantized pool (kv_cache_dtype) there")
            from minipd.kv.spec import KV_DTYPES

            pool_dtype = llm_options.get("kv_cache_dtype", "auto")
            if pool_dtype != "auto" and pool_dtype not in KV_DTYPES:
                raise ParameterError("kv_transfer_dtype",
                                     f"kv_transfer_dtype compresses a float pool on the wire; with kv_cache_dtype="
                                     f"{pool_dtype!r} the blocks travel compressed already")
        self.kv_transfer_dtype = kv_transfer_dtype
        EngineConfig.from_options({k: v for k, v in llm_options.items()
                                   if k not in ("device", "dtype", "max_model_len", "seed")})
        if llm_options.get("kv_cache_dtype") == "adaptive":
            raise ParameterError("kv_cache_dtype",
                                 "kv_cache_dtype='adaptive' mixes formats within one pool, which KV transfer does not "
                                 "handle yet; pick one format for disaggregated serving")
        folder = resolve_model(model)
        self.model_name = folder.name
        self.config = ModelConfig.from_pretrained(folder)
        self.tokenizer = Tokenizer(folder)
        self.max_model_len = llm_options.get("max_model_len") or self.config.max_position_embeddings
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.block_size = llm_options.get("block_size", EngineConfig.block_size)
        self.processor = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(seed if seed is not None else time.time_ns())
        self._next_id = 0
        self._flights: dict[str, _Flight] = {}
        self._workers: dict[str, _Worker] = {}
        #: Requests sent to another worker because theirs died or a K/V read failed.
        self.num_recovered_requests = 0
        #: Requests held back before prefill, at least once, because no decode worker had room for them
        #: (backpressure).
        self.num_backpressured = 0
        self._backlog: list[_Flight] = []
        self._deltas: list[StreamDelta] = []  # produced by the pump since the last step()
        # At exit, shut down whatever is still running; through a weak reference, so that dropping the
        # last reference to this object still shuts it down (__del__) instead of keeping it for ever.
        self._at_exit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._at_exit)
        self._closed = False
        if listen is not None:
            self._codec = Codec(cluster_secret(secret, create=True))
            self._join(str(model), listen, num_prefill_workers, num_decode_workers, kv_lease_s, threads_per_worker,
                       start_timeout, llm_options)
        else:
            self._codec = Codec(new_key())
            self._start(str(folder), num_prefill_workers, num_decode_workers, kv_lease_s, threads_per_worker,
                        start_timeout, llm_options)

    @property
    def kv_transfer(self) -> str:
        """How the K/V of requests submitted from now on move: ``"pull"``, ``"push"`` or ``"layerwise"``."""
        return self._kv_transfer

    @kv_transfer.setter
    def kv_transfer(self, mode: str) -> None:
        if mode not in KV_TRANSFERS:
            raise ParameterError("kv_transfer",
                                 f"kv_transfer must be one of {', '.join(map(repr, KV_TRANSFERS))}, got {mode!r}")
        self._kv_transfer = mode

    # ------------------------------------------------------------------------------- processes
    def _start(self, model: str, num_prefill: int, num_decode: int, kv_lease_s: float, threads: int | None,
               timeout: float, llm_options: dict) -> None:
        import zmq

        self._context = zmq.Context()
        self._folder = tempfile.mkdtemp(prefix="minipd-pd-")
        outbox = f"ipc://{self._folder}/out"
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(outbox)
        spawn = mp.get_context("spawn")
        world = num_prefill + num_decode
        address = f"tcp://127.0.0.1:{free_port()}" if self.kv_transport == "torch" else ""
        try:
            for role, count in (("prefill", num_prefill), ("decode", num_decode)):
                for index in range(count):
                    name = f"{role}{index}"
                    inbox = f"ipc://{self._folder}/{name}"
                    socket = self._context.socket(zmq.PUSH)
                    socket.bind(inbox)
                    transport = {"name": self.kv_transport, "rank": len(self._workers), "world_size": world,
                                 "address": address, "wire_dtype": self.kv_transfer_dtype}
                    process = spawn.Process(target=run_worker, name=f"minipd-{name}", daemon=True,
                                            args=(role, index, model, llm_options, inbox, outbox, kv_lease_s,
                                                  threads, transport, self._codec.key))
                    process.start()
                    self._workers[name] = _Worker(name, role, process, socket)
            self._wait_ready(timeout)
            self._introduce()
        except BaseException:
            self.shutdown()
            raise

    def _join(self, model: str, listen: str, num_prefill: int, num_decode: int, kv_lease_s: float,
              threads: int | None, timeout: float, llm_options: dict) -> None:
        """Wait for launched workers to say hello at ``listen``, then configure them (see ``listen``)."""
        import zmq

        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        hellos: list[dict] = []  # in the order they came, with the name each worker was given
        try:
            self._pull.bind(listen)
            wanted = {"prefill": num_prefill, "decode": num_decode}
            deadline = time.monotonic() + timeout
            while len(hellos) < num_prefill + num_decode:
                if time.monotonic() > deadline:
                    have = {r: sum(h["role"] == r for h in hellos) for r in wanted}
                    raise WorkerError(f"only {have} of {wanted} workers joined at {listen} in {timeout:.0f} s")
                message = self._receive(0.2)
                if message is None or message.get("kind") != "hello":
                    continue
                if not _well_formed_hello(message):
                    logger.warning("ignored a malformed hello at %s: %.200r", listen, message)
                    continue
                socket = self._context.socket(zmq.PUSH)
                socket.connect(message["inbox"])
                joined = sum(h["role"] == message["role"] for h in hellos)
                if joined >= wanted[message["role"]]:
                    socket.send(self._codec.encode(("shutdown",)))  # one too many of its role: send it home
                    socket.close(linger=1000)
                    continue
                # Registered at once, so that shutdown sends it home whatever happens next.
                message["name"] = f"{message['role']}{joined}"
                self._workers[message["name"]] = _Worker(message["name"], message["role"], None, socket,
                                                         pid=message["pid"], last_seen=time.monotonic())
                hellos.append(message)
            ranks = [h["torchrun"] for h in hellos]
            if all(ranks):  # torchrun numbered them and set up the rendezvous
                address, order = "env://", [r[0] for r in ranks]
            else:  # rank 0 hosts torch.distributed's store, on the port it found free
                address, order = f"tcp://{hellos[0]['host']}:{hellos[0]['free_port']}", list(range(len(hellos)))
            for hello, rank in zip(hellos, order, strict=True):
                transport = {"name": self.kv_transport, "rank": rank, "world_size": len(hellos), "address": address,
                             "wire_dtype": self.kv_transfer_dtype}
                self._send(self._workers[hello["name"]],
                           ("config", hello["name"], model, llm_options, kv_lease_s, threads, transport))
            self._wait_ready(max(1.0, deadline - time.monotonic()))
            self._introduce()
        except BaseException:
            self.shutdown()
            raise

    def _introduce(self) -> None:
        """Tell every worker how to reach every other: readers their sources, writers their destinations
        (any mode may be chosen later), and for torch every rank its partners."""
        for worker in self._workers.values():
            for peer in self._workers.values():
                if peer is not worker:
                    self._send(worker, ("add_peer", peer.peer))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = set(self._workers)
        while waiting:
            if time.monotonic() > deadline:
                raise WorkerError(f"workers {sorted(waiting)} were not ready after {timeout:.0f} s")
            message = self._receive(0.2)
            if message is None:
                # (A launched worker says nothing while it loads: only its start timeout bounds it.)
                dead = [n for n in waiting if self._workers[n].process is not None and not self._workers[n].alive]
                if dead:
                    raise WorkerError(f"worker {dead[0]} exited while starting")
                continue
            if message["kind"] == "error":
                raise WorkerError(message["message"])
            if message["kind"] == "ready":
                worker = self._workers[message["worker"]]
                worker.pid, worker.peer = message["pid"], message["peer"]
                worker.free_blocks = worker.num_blocks = message["num_kv_blocks"]
                engine = message.get("engine")
                worker.engine = {str(k): str(v) for k, v in engine.items()} if isinstance(engine, dict) else {}
                # From now on its silence is judged (loading the model may take any time).
                worker.last_seen, worker.silence_limit = time.monotonic(), self._heartbeat_timeout
                waiting.discard(worker.name)

    def describe(self) -> dict:
        """What this cluster runs with: KV transfer and transport, the workers, and each role's engine
        (kernels, linears, KV format, compiled decode, as the first live worker of the role reported)."""
        info: dict[str, Any] = {"model": self.model_name, "kv_transfer": self.kv_transfer,
                                "kv_transport": self.kv_transport,
                                "kv_transfer_dtype": self.kv_transfer_dtype}
        for role in ("prefill", "decode"):
            workers = [w for w in self._workers.values() if w.role == role and not w.fenced]
            info[f"num_{role}_workers"] = len(workers)
            if workers:
                info[f"{role}_engine"] = dict(workers[0].engine)
        return info

    def __repr__(self) -> str:
        return f"DisaggregatedLLM({', '.join(f'{k}={v!r}' for k, v in self.describe().items())})"

    def worker_pids(self) -> dict[str, list[int]]:
        """The pids of the live workers, by role (kill one to watch the others take over)."""
        if not self._closed:  # launched workers are judged by their heartbeats: read those that wait
            self._pump(0.0)
        return {role: [w.pid for w in self._workers.values() if w.role == role and w.alive]
                for role in ("prefill", "decode")}

    def shutdown(self) -> None:
        """Stop every worker (killing those that do not stop within 10 s) and free the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers.values():
            # A launched worker may only look dead because nobody listened to its heartbeats: tell it anyway.
            if worker.process is None or worker.alive:
                with contextlib.suppress(Exception):
                    self._send(worker, ("shutdown",))
            if worker.process is not None and worker.fenced:
                worker.process.kill()  # (already killed when fenced; a stopped one may not have died yet)
        deadline = time.monotonic() + 10
        for worker in self._workers.values():
            if worker.process is None:  # launched by hand: not ours to kill; the message must get out
                worker.socket.close(linger=2000)
                continue
            worker.process.join(timeout=max(0.1, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=10)
            worker.socket.close(linger=0)
        if hasattr(self, "_pull"):
            self._pull.close(linger=0)
            self._context.term()
        if hasattr(self, "_folder"):
            shutil.rmtree(self._folder, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self._at_exit)

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def _role(self, role: str) -> list[_Worker]:
        return [w for w in self._workers.values() if w.role == role and w.alive]

    def _send(self, worker: _Worker, message: tuple) -> None:
        send_nowait(worker.socket, self._codec.encode(message), lambda: worker.alive, WorkerError,
                    f"worker {worker.name}")

    def _receive(self, timeout: float) -> dict | None:
        """The next message from a worker (waiting up to ``timeout`` for one); None when none came.

        A message that is not signed with this cluster's key, not well formed, or from a worker that is
        unknown or fenced is logged and dropped: it is never acted on."""
        deadline = time.monotonic() + timeout
        while (message := receive(self._pull, self._codec, max(0.0, deadline - time.monotonic()), "minipd front end")
               ) is not None:
            if not (isinstance(message, dict) and isinstance(message.get("kind"), str)):
                logger.warning("dropped a message that is not a worker's report: %.200r", message)
                continue
            if message["kind"] == "hello":
                return message
            worker = self._workers.get(message.get("worker"))  # type: ignore[arg-type]
            if worker is None or worker.fenced:
                continue  # a worker declared dead: whatever it says now is too late
            worker.last_seen = time.monotonic()
            return message
        return None

    # -------------------------------------------------------------------------------- requests
    def _encode(self, prompt: PromptInput, index: int) -> tuple[list[int], str | None]:
        return encode_prompt(self.tokenizer, prompt, index, self.config.vocab_size, self.max_model_len)

    def _submit_one(self, prompt: PromptInput, sampling_params: SamplingParams | None, what: str,
                    request_id: str | None = None) -> RequestState:
        prompts = normalize_prompts(prompt)
        if len(prompts) != 1:
            raise ParameterError(what, f"{what} takes one prompt, got {len(prompts)}; use generate for several")
        (params,) = normalize_params(sampling_params, 1)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ParameterError("request_id", f"request_id must be a non-empty string, got {request_id!r}")
        if request_id is not None and request_id in self._flights:
            raise ParameterError("request_id", f"request_id {request_id!r} is already in use by a running request")
        ids, text = self._encode(prompts[0], 0)
        self._check_fits(ids, params, 0)
        return self._submit(ids, text, params, request_id)

    def _check_fits(self, ids: list[int], params: SamplingParams, index: int) -> None:
        """Refuse a request that could never fit the smallest worker pool, however long it waited."""
        smallest = min(w.num_blocks for w in self._workers.values())
        check_fits_pool(len(ids), params.max_tokens, self.max_model_len, self.block_size, smallest,
                        f"prompts[{index}]", "the workers' pools have")

    def _submit(self, ids: list[int], text: str | None, params: SamplingParams,
                request_id: str | None = None) -> RequestState:
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")
        # Routing asks which workers are alive; launched ones are judged by heartbeats that may have
        # waited unread while nobody called us.
        self._pump(0.0)
        while request_id is None or request_id in self._flights:  # automatic ids skip callers' ids
            request_id = str(self._next_id)
            self._next_id += 1
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        state = self.processor.new_state(request_id, text, ids, params, time.perf_counter())
        request = Request(request_id=request_id, all_token_ids=list(ids), num_prompt_tokens=len(ids), params=params,
                          seed=seed, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                          arrival_time=state.metrics.arrival_time)
        self.processor.add(state)
        flight = _Flight(state, request, mode=self._kv_transfer)
        self._flights[request_id] = flight
        if self._backlog or not self._decode_has_room(flight):
            # Backpressure: the prompt waits here (its TTFT grows) rather than piling up in a decode queue.
            self._hold_back(flight)
        else:
            self._to_prefill(flight)
        return state

    def _blocks_for(self, flight: _Flight) -> int:
        return -(-(len(flight.request.all_token_ids) + 1) // self.block_size)

    def _decode_has_room(self, flight: _Flight) -> bool:
        """Whether some decode worker can take ``flight`` once prefilled, counting the prefills on their way."""
        decoders = self._role("decode")
        if not decoders:
            return True  # the prefill workers decode themselves
        # Prefills whose blocks are not reserved yet (push modes reserve, and free_blocks already counts
        # them) will each go where the router sends them: to the worker with the most room at the time.
        room = [w.free_blocks for w in decoders]
        for other in self._flights.values():
            if other.phase == "prefill" and other.worker and not other.dest:
                room[room.index(max(room))] -= self._blocks_for(other)
        return max(room) >= self._blocks_for(flight)

    def _hold_back(self, flight: _Flight, first: bool = False) -> None:
        """Put ``flight`` in the backlog (at its head when it was already admitted once)."""
        if not flight.held_back:
            flight.held_back = True
            self.num_backpressured += 1
        self._backlog.insert(0 if first else len(self._backlog), flight)

    def _admit_backlog(self) -> None:
        while self._backlog and self._decode_has_room(self._backlog[0]):
            self._to_prefill(self._backlog.pop(0))

    def _to_prefill(self, flight: _Flight) -> None:
        workers = self._role("prefill")
        if not workers:
            return self._to_decode(flight, recompute=True)
        decoders = self._role("decode")
        if flight.mode != "pull" and decoders:
            # Push modes: first reserve blocks on a decode worker, then prefill straight into them.
            dest = max(decoders, key=lambda w: w.free_blocks)
            dest.free_blocks -= self._blocks_for(flight)
            flight.phase, flight.dest, flight.kv_done = "reserving", dest.name, False
            dest.requests.add(flight.request.request_id)
            self._send(dest, ("reserve", flight.request.request_id, len(flight.request.all_token_ids)))
            return None
        return self._prefill_on(flight, min(workers, key=lambda w: len(w.requests)))

    def _prefill_on(self, flight: _Flight, worker: _Worker, dest_blocks: list[int] | None = None) -> None:
        # The prefill worker samples only the first token, then keeps the prompt's K/V for the reader.
        first_only = dataclasses.replace(flight.request, params=dataclasses.replace(flight.request.params,
                                                                                   max_tokens=1),
                                         hold_kv=bool(self._role("decode")), all_token_ids=list(
                                             flight.request.all_token_ids))
        self._assign(flight, worker, "prefill")
        if dest_blocks is None:
            self._send(worker, ("add", first_only))
        else:
            self._send(worker, ("add_push", first_only, flight.dest, dest_blocks, flight.mode == "layerwise"))
        return None

    def _on_reserved(self, flight: _Flight, blocks: list[int] | None) -> None:
        dest = self._workers[flight.dest]
        dest.requests.discard(flight.request.request_id)
        workers = self._role("prefill")
        if blocks is None or not workers:  # no room after all (or no prefill worker): wait, or go on without
            flight.phase, flight.dest = "prefill", ""
            if blocks is not None:
                self._send(dest, ("release_reservation", flight.request.request_id, False))
            if not workers:
                return self._to_decode(flight, recompute=True)
            self._hold_back(flight, first=True)
            return None
        return self._prefill_on(flight, min(workers, key=lambda w: len(w.requests)), blocks)

    def _to_decode(self, flight: _Flight, recompute: bool, peer: str = "", blocks: Sequence[int] = ()) -> None:
        """Continue a request on a decode worker: reading its K/V from ``peer``, or recomputing its tokens."""
        state = flight.state
        if recompute:  # no transfer to wait for: anything still reported about one is stale
            flight.kv_done, flight.dest = True, ""
        tokens = [*state.prompt_token_ids, *state.token_ids]
        request = dataclasses.replace(flight.request, all_token_ids=tokens, hold_kv=False,
                                      num_external_tokens=0 if recompute else len(state.prompt_token_ids))
        workers = self._role("decode")
        if not workers:
            workers = self._role("prefill")  # no decode worker left: a prefill worker decodes
            if not workers:
                raise WorkerError("every worker is gone")
            worker = min(workers, key=lambda w: len(w.requests))
            self._assign(flight, worker, "decode")
            self._send(worker, ("add", dataclasses.replace(request, num_external_tokens=0)))
            return
        worker = max(workers, key=lambda w: w.free_blocks)
        self._assign(flight, worker, "decode")
        if recompute:
            self._send(worker, ("add", request))
        else:
            # Reserve the blocks now, so the next request is not routed as if they were free.
            worker.free_blocks -= -(-len(tokens) // self.block_size)
            self._send(worker, ("add_remote", request, peer, list(blocks)))

    def _assign(self, flight: _Flight, worker: _Worker, phase: str) -> None:
        old = self._workers.get(flight.worker)
        if old is not None:
            old.requests.discard(flight.request.request_id)
        flight.worker, flight.phase = worker.name, phase
        worker.requests.add(flight.request.request_id)
        if phase == "prefill":
            flight.state.metrics.prefill_worker = worker.name
        else:
            flight.state.metrics.decode_worker = worker.name

    # -------------------------------------------------------------------------------- the pump
    def _pump(self, timeout: float = 0.05) -> None:
        """Take every message that has arrived (waiting up to ``timeout`` for the first); check for deaths."""
        message = self._receive(timeout)
        while message is not None:
            self._on_message(message)
            message = self._receive(0.0)
        for worker in list(self._workers.values()):
            if not worker.fenced and not worker.alive:
                self._fence(worker, "its process exited" if worker.process is not None
                            and not worker.process.is_alive() else
                            f"it was silent for more than {self._heartbeat_timeout:g} s")
        now = time.monotonic()
        for flight in [f for f in self._flights.values() if f.parked and now - f.parked[2] > self._lease_s]:
            self._unpark(flight)  # a report that never came must not hold the request back for ever
        self._admit_backlog()

    def _fence(self, worker: _Worker, why: str) -> None:
        """Declare ``worker`` dead: never hear or route to it again, stop it, recover its requests elsewhere."""
        worker.fenced = True
        logger.warning("worker %s is taken for dead (%s); its requests go elsewhere", worker.name, why)
        if worker.process is not None:
            # Ours to stop: a stopped or wedged process must not wake up and write K/V into blocks that
            # were given to other requests meanwhile.
            with contextlib.suppress(Exception):
                os.kill(worker.process.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(Exception):  # a launched worker: tell it to leave, should it come back
                worker.socket.send(self._codec.encode(("shutdown",)), flags=_zmq_noblock())
        if worker.requests:
            self._on_death(worker)

    def _on_message(self, message: dict) -> None:
        kind = message["kind"]
        if kind in ("heartbeat", "hello"):  # a heartbeat's news is its arrival; a late hello is not wanted
            return
        worker = self._workers[message["worker"]]
        if kind == "outputs":
            worker.free_blocks = message["free_blocks"]
            held = message["held"]
            for request_id, timeline in message.get("timelines", {}).items():
                flight = self._flights.get(request_id)
                if flight is not None:
                    flight.state.metrics.kv_timeline = KVTimeline(flight.mode, **timeline)
            for out in message["outputs"].outputs:
                self._on_output(worker, out, message["outputs"].timestamp, held.get(out.request_id))
        elif kind == "reserved":
            flight = self._flights.get(message["request_id"])
            if flight is None or flight.phase != "reserving":
                if message["blocks"] is not None:
                    self._send(worker, ("release_reservation", message["request_id"], False))
            else:
                self._on_reserved(flight, message["blocks"])
        elif kind == "kv_loaded":
            flight = self._flights.get(message["request_id"])
            if flight is not None:
                flight.kv_done = True
                m = flight.state.metrics
                m.kv_transfer_bytes += message["bytes"]
                m.kv_transfer_start, m.kv_transfer_end = message["start"], message["end"]
                if message.get("compute_end"):  # pushed: how much of the transfer ran while the prefill computed
                    span = max(message["end"] - message["start"], 1e-9)
                    m.kv_transfer_hidden = min(1.0, max(0.0, (message["compute_end"] - message["start"]) / span))
                if "timeline" in message:  # pushed: the prefill worker measured it all
                    m.kv_timeline = KVTimeline(flight.mode, **message["timeline"])
                if m.kv_timeline is not None:
                    m.kv_timeline.transfer = (message["start"], message["end"])
                self._unpark(flight)
        elif kind == "kv_failed":
            flight = self._flights.get(message["request_id"])
            if flight is not None and flight.parked is not None:  # it finished: the K/V were there
                flight.kv_done = True
                self._unpark(flight)
            elif flight is not None and not flight.kv_done:
                flight.kv_done = True  # whatever else comes for this transfer is stale
                if flight.phase == "decode":
                    self.num_recovered_requests += 1
                    if flight.dest and self._workers[flight.dest].alive:
                        self._send(self._workers[flight.dest], ("release_reservation", flight.request.request_id,
                                                                True))
                    flight.dest = ""
                    self._to_decode(flight, recompute=True)
        elif kind == "warning":
            logger.warning("%s: %s", message["worker"], message["message"])
        elif kind == "error":
            request_id = message.get("request_id")
            flight = self._flights.pop(request_id, None) if request_id else None
            if flight is not None:
                self._finish_with_error(flight, message["message"])
            elif not request_id:  # the worker's engine failed and the worker exits: recover as from a death
                self._fence(worker, f"it failed: {str(message['message']).splitlines()[0]}")

    def _on_output(self, worker: _Worker, out: EngineCoreOutput, timestamp: float, held: list[int] | None) -> None:
        flight = self._flights.get(out.request_id)
        if flight is None or flight.worker != worker.name:
            if held is not None:  # nobody will read these blocks any more
                self._send(worker, ("release_kv", out.request_id))
            return
        if flight.phase == "prefill" and worker.role == "prefill" and out.finish_reason is FinishReason.LENGTH \
                and self._continues(flight, out):
            # The first token is in; decoding goes on elsewhere.
            flight.prefill_tokens, flight.cached_tokens = out.num_prefill_tokens, out.num_cached_tokens
            out = dataclasses.replace(out, finish_reason=None)
            self._deliver(flight, out, timestamp)
            if not flight.state.finished:
                if flight.dest and self._workers[flight.dest].alive:
                    self._adopt(flight)
                elif held is not None:
                    self._to_decode(flight, recompute=False, peer=worker.name, blocks=held)
                else:
                    self._to_decode(flight, recompute=True)
            else:
                self._let_go(flight, worker, held)
            return
        if flight.phase == "prefill":
            self._let_go(flight, worker, held)
        elif held is not None:
            self._send(worker, ("release_kv", out.request_id))
        out = dataclasses.replace(out, num_prefill_tokens=out.num_prefill_tokens + flight.prefill_tokens,
                                  num_cached_tokens=out.num_cached_tokens + flight.cached_tokens)
        prefill_worker = self._workers.get(flight.state.metrics.prefill_worker or "")
        if out.finished and flight.dest and not flight.kv_done and prefill_worker is not None \
                and prefill_worker.alive:  # a push into this worker's reservation is still unreported
            flight.parked = (out, timestamp, time.monotonic())
            return
        self._deliver(flight, out, timestamp)

    def _unpark(self, flight: _Flight) -> None:
        """Deliver a final output that waited for its transfer's report."""
        if flight.parked is not None:
            out, timestamp, _ = flight.parked
            flight.parked = None
            self._deliver(flight, out, timestamp)

    def _adopt(self, flight: _Flight) -> None:
        """Push modes: the decode worker takes the request into the blocks the prefill worker writes into."""
        state, dest = flight.state, self._workers[flight.dest]
        request = dataclasses.replace(flight.request, all_token_ids=[*state.prompt_token_ids, *state.token_ids],
                                      hold_kv=False, num_external_tokens=len(state.prompt_token_ids))
        self._assign(flight, dest, "decode")
        self._send(dest, ("adopt", request))

    def _let_go(self, flight: _Flight, worker: _Worker, held: list[int] | None) -> None:
        """A request ended at its first token: free what was kept for its decode."""
        if held is not None:
            self._send(worker, ("release_kv", flight.request.request_id))
        if flight.dest and self._workers[flight.dest].alive:
            # Its K/V may still be on their way into the reservation: the decode worker frees it once
            # the prefill worker says its writes are over.
            self._send(self._workers[flight.dest], ("release_reservation", flight.request.request_id, True))
        flight.dest = ""

    def _continues(self, flight: _Flight, out: EngineCoreOutput) -> bool:
        """Whether a prefill that ended by length (its forced max_tokens=1) still has tokens to produce."""
        produced = len(flight.state.token_ids) + len(out.new_token_ids)
        total = len(flight.state.prompt_token_ids) + produced
        return produced < flight.request.params.max_tokens and total < self.max_model_len

    def _deliver(self, flight: _Flight, out: EngineCoreOutput, timestamp: float) -> None:
        deltas, to_abort = self.processor.process(EngineCoreOutputs([out], timestamp))
        self._deltas.extend(deltas)
        worker = self._workers[flight.worker]
        if to_abort:  # a stop string: the worker must end it too
            self._send(worker, ("abort", to_abort, FinishReason.STOP))
        if flight.state.finished:
            worker.requests.discard(flight.request.request_id)
            self._flights.pop(flight.request.request_id, None)

    def _on_death(self, worker: _Worker) -> None:
        """Send the dead worker's unfinished requests elsewhere, recomputed from the tokens produced so far."""
        orphans = [self._flights[r] for r in sorted(worker.requests, key=int) if r in self._flights]
        worker.requests.clear()
        for flight in [f for f in self._flights.values() if f.parked and f.state.metrics.prefill_worker == worker.name]:
            self._unpark(flight)  # its transfer report will never come
        self.num_recovered_requests += len(orphans)
        for flight in orphans:
            if flight.dest and flight.dest != worker.name and self._workers[flight.dest].alive:
                # Its prefill worker died: the decode worker's reservation will never be filled.
                self._send(self._workers[flight.dest], ("release_reservation", flight.request.request_id, False))
            flight.dest, flight.kv_done = "", True
            if flight.phase in ("prefill", "reserving"):
                self._to_prefill(flight)
            else:
                self._to_decode(flight, recompute=True)

    def _finish_with_error(self, flight: _Flight, message: str) -> None:
        self._workers[flight.worker].requests.discard(flight.request.request_id)
        self.processor.process(EngineCoreOutputs([EngineCoreOutput(flight.request.request_id, [],
                                                                   FinishReason.ABORT)], time.perf_counter()))
        flight.state.stop_reason = message

    # ------------------------------------------------------------------------------------ API
    def abort(self, request_id: str | Sequence[str]) -> list[str]:
        """End requests now, wherever they are (held back, prefilling, with K/V in transfer, decoding).

        Takes one id or a list of ids, as vLLM's ``abort``; unknown or finished ids are ignored.
        Each aborted request ends with finish reason ``"abort"`` (a stream following it gets that
        delta), and the worker holding it frees its blocks. Returns the ids that were aborted.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise ParameterError("request_id", f"request_id must be a string or a list of strings, got {request_id!r}")
        aborted = []
        for rid in ids:
            flight = self._flights.pop(rid, None)
            if flight is None:
                continue
            if flight in self._backlog:
                self._backlog.remove(flight)
            worker = self._workers.get(flight.worker)
            if worker is not None:
                worker.requests.discard(rid)
                if worker.alive:
                    self._send(worker, ("abort", [rid], FinishReason.ABORT))
            dest = self._workers.get(flight.dest)
            if dest is not None:
                dest.requests.discard(rid)
                if dest.alive and dest is not worker:
                    # Writes into its reservation may be under way: it is freed once they are over.
                    self._send(dest, ("release_reservation", rid, flight.phase != "reserving"))
            flight.parked = None
            self.processor.process(EngineCoreOutputs([EngineCoreOutput(rid, [], FinishReason.ABORT)],
                                                     time.perf_counter()))
            aborted.append(rid)
        return aborted

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt across the workers; one :class:`RequestOutput` per prompt, in order."""
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")
        prompt_list = normalize_prompts(prompts)
        params = normalize_params(sampling_params, len(prompt_list))
        encoded = [self._encode(p, i) for i, p in enumerate(prompt_list)]  # every prompt checked before any runs
        for i, ((ids, _), sp) in enumerate(zip(encoded, params, strict=True)):
            self._check_fits(ids, sp, i)
        states = [self._submit(ids, text, sp) for (ids, text), sp in zip(encoded, params, strict=True)]
        while not all(s.finished for s in states):
            self._pump()
            self._deltas.clear()  # nobody steps this call's requests but generate itself
        return [s.to_output() for s in states]

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> RequestStream:
        """Send ``prompt`` now and return its :class:`RequestStream`: one :class:`StreamDelta` per token as it
        arrives from the workers. Closing the stream (or dropping it) before its last delta aborts the
        request on whichever worker holds it; ``stream.request_id`` can be passed to :meth:`abort`."""
        state = self._submit_one(prompt, sampling_params, "stream")
        outbox = self.processor.watch(state.request_id)

        def follow() -> Iterator[StreamDelta]:
            while True:
                while outbox:
                    delta = outbox.popleft()
                    yield delta
                    if delta.finished:
                        return
                self._pump()
                self._deltas.clear()

        def end() -> None:
            if not state.finished and not self._closed:
                self.abort(state.request_id)

        return RequestStream(state.request_id, follow(), end)

    def add_request(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> str:
        """Check and send one prompt now; returns its id. Follow it with :meth:`step` (as ``Engine`` is followed)."""
        return self._submit_one(prompt, sampling_params, "add_request").request_id

    def step(self, timeout: float = 0.05) -> list[StreamDelta]:
        """Take what the workers sent (waiting up to ``timeout``); return the deltas it produced."""
        self._pump(timeout)
        deltas, self._deltas = self._deltas, []
        return deltas

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight."""
        return bool(self._flights)

    def inject_fault(self, worker: str, fault: str) -> None:
        """Make a worker misbehave on purpose, to watch recovery: ``"lose_reads"`` (every K/V read the
        decode worker starts vanishes in flight, so leases must expire and requests be recomputed) or
        ``"slow_writes"`` (with ``kv_transport="torch"``: every K/V write into this worker lands 20 ms
        late, so writes are still arriving when the front end has moved on) or ``"late_reports"``
        (a prefill worker's reports of finished pushes reach the front end 0.3 s late, after the
        decode worker may have finished the request)."""
        if fault not in ("lose_reads", "slow_writes", "late_reports"):
            raise ParameterError("fault", f"fault must be 'lose_reads', 'slow_writes' or 'late_reports', got {fault!r}")
        if fault == "slow_writes" and self.kv_transport != "torch":
            raise ParameterError("fault",
                                 "fault 'slow_writes' needs kv_transport='torch' (NIXL writes land without the "
                                 "receiving worker's help)")
        if worker not in self._workers:
            raise ParameterError("worker", f"worker must be one of {', '.join(self._workers)}, got {worker!r}")
        self._send(self._workers[worker], ("fault", fault))

    def worker_stats(self, timeout: float = 10.0) -> dict[str, dict]:
        """Each live worker's KV blocks used and free and its live requests (asked now)."""
        asked = {w.name for w in self._workers.values() if w.alive}
        for name in asked:
            self._send(self._workers[name], ("stats",))
        stats: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while set(stats) != asked and time.monotonic() < deadline:
            message = self._receive(0.1)
            if message is None:
                continue
            if message["kind"] == "stats":
                stats[message["worker"]] = {k: message[k] for k in ("used_blocks", "free_blocks", "live_requests")}
            else:
                self._on_message(message)
        return stats


def _shutdown_if_alive(ref: weakref.ref) -> None:
    """At exit: shut down the front end ``ref`` points to, if it still exists."""
    llm = ref()
    if llm is not None:
        llm.shutdown()


def _zmq_noblock() -> int:
    import zmq

    return zmq.NOBLOCK


def _well_formed_hello(message: dict) -> bool:
    """Whether a launched worker's hello has every field, of the right type (it came over TCP, signed)."""
    torchrun = message.get("torchrun")
    return (message.get("role") in ("prefill", "decode") and isinstance(message.get("inbox"), str)
            and message["inbox"].startswith("tcp://") and isinstance(message.get("host"), str)
            and isinstance(message.get("free_port"), int) and isinstance(message.get("pid"), int)
            and (torchrun is None or (isinstance(torchrun, tuple) and len(torchrun) == 2
                                      and all(isinstance(x, int) for x in torchrun))))


__all__ = ["DisaggregatedLLM", "WorkerError"]
