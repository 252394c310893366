"""``DisaggregatedLLM``: prefill and decode in separate worker processes, in :class:`~minipd.llm.LLM`'s shape.

It is the same front end as ``LLM`` (:class:`~minipd.engine.front_end.FrontEnd`: tokenising, request
ids and seeds, detokenising, stop strings, logprobs; :class:`~minipd.llm_base.LLMBase`: ``generate``,
``chat``, ``stream``, ``abort``) over another engine core: the cluster of workers,
:class:`~minipd.pd.cluster.ClusterCore`, which routes each request through prefill and decode workers
(:mod:`minipd.pd.worker`, started or joined by :class:`~minipd.pd.processes.WorkerGroup`) and moves its
K/V between them. What is left here is what is really about disaggregation: choosing and starting the
workers, the transfer mode, fault injection and the workers' own statistics.

If a worker dies, the cluster notices within a poll and sends its unfinished requests elsewhere,
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
import functools
import logging
import os
import threading
import weakref
from typing import Any

from minipd.config import ModelConfig
from minipd.engine.config import EngineConfig
from minipd.engine.front_end import FrontEnd, eos_token_ids
from minipd.engine.output_processor import OutputProcessor
from minipd.errors import ParameterError
from minipd.kv.quant import PER_TOKEN_FORMATS
from minipd.llm_base import LLMBase
from minipd.models.registry import resolve_model
from minipd.outputs import StreamDelta
from minipd.pd.cluster import KV_TRANSFERS, ClusterCore
from minipd.pd.processes import Transport, WorkerError, WorkerGroup
from minipd.pd.routing import Router
from minipd.pd.transport import TRANSPORTS, nixl_available
from minipd.sampling_params import SamplingParams, check_seed
from minipd.tokenizer import Tokenizer
from minipd.wire import Codec, cluster_secret, new_key

logger = logging.getLogger("minipd")


class DisaggregatedLLM(LLMBase):
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
        router: the routing and backpressure policy, a :class:`~minipd.pd.routing.Router` (None: the
            default one: prefills to the least busy worker, decodes to the most free KV blocks).
        **llm_options: each worker's engine options, as ``LLM`` takes them (``max_model_len``, ``device``, and
            :class:`~minipd.engine.config.EngineConfig` fields, flat or by group); each worker builds its core with
            :func:`~minipd.engine.factory.build_core`.
    """

    def __init__(self, model: str | os.PathLike = "tiny-py", *, num_prefill_workers: int = 1,
                 num_decode_workers: int = 1, kv_transfer: str = "layerwise", kv_transport: str | None = None,
                 kv_transfer_dtype: str | None = None, kv_lease_s: float = 30.0,
                 threads_per_worker: int | None = 1, seed: int | None = None, start_timeout: float = 180.0,
                 listen: str | None = None, heartbeat_timeout: float = 10.0,
                 secret: str | bytes | os.PathLike | None = None, router: Router | None = None,
                 **llm_options: Any) -> None:
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
        if router is not None and not isinstance(router, Router):
            raise ParameterError("router", f"router must be a minipd.pd.Router or None, got {type(router).__name__}")
        llm_options = EngineConfig.flatten(llm_options)  # (engine options given by group read as flat ones)
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
        if kv_transfer not in KV_TRANSFERS:
            raise ParameterError("kv_transfer", f"kv_transfer must be one of {', '.join(map(repr, KV_TRANSFERS))}, "
                                                f"got {kv_transfer!r}")
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
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        self.block_size = llm_options.get("block_size", EngineConfig.block_size)
        self._lock = threading.RLock()
        # At exit, shut down whatever is still running; through a weak reference, so that dropping the
        # last reference to this object still shuts it down (__del__) instead of keeping it for ever.
        self._at_exit = functools.partial(_shutdown_if_alive, weakref.ref(self))
        atexit.register(self._at_exit)
        transport = Transport(kv_transport, kv_transfer_dtype)
        if listen is not None:
            self.workers = WorkerGroup(Codec(cluster_secret(secret, create=True)), float(heartbeat_timeout))
            self._closed = False
            self.workers.join(str(model), listen, num_prefill_workers, num_decode_workers, kv_lease_s,
                              threads_per_worker, start_timeout, llm_options, transport)
        else:
            self.workers = WorkerGroup(Codec(new_key()), float(heartbeat_timeout))
            self._closed = False
            self.workers.start(str(folder), num_prefill_workers, num_decode_workers, kv_lease_s, threads_per_worker,
                               start_timeout, llm_options, transport)
        #: The engine core: the cluster of workers behind the core protocol.
        self.core = ClusterCore(self.workers, self.block_size, self.max_model_len, kv_transfer, float(kv_lease_s),
                                router=router)
        #: The front end, as ``LLM.engine``: add_request / step / abort over the cluster.
        self.engine = FrontEnd(self.core, self.tokenizer, self.max_model_len, self.eos_token_ids,
                               self.config.vocab_size, seed)

    # ------------------------------------------------------------------------------ the cluster
    @property
    def kv_transfer(self) -> str:
        """How the K/V of requests submitted from now on move: ``"pull"``, ``"push"`` or ``"layerwise"``."""
        return self.core.kv_transfer

    @kv_transfer.setter
    def kv_transfer(self, mode: str) -> None:
        self.core.kv_transfer = mode

    @property
    def processor(self) -> OutputProcessor:
        """The front end's output processor (request states, counters)."""
        return self.engine.processor

    @property
    def num_recovered_requests(self) -> int:
        """Requests sent to another worker because theirs died or a K/V read failed."""
        return self.core.num_recovered_requests

    @property
    def num_backpressured(self) -> int:
        """Requests held back before prefill, at least once, because no decode worker had room for them."""
        return self.core.num_backpressured

    @property
    def step_stats(self) -> Any:
        """Every worker step's record (``StepStats.worker`` names the worker), most recent last."""
        return self.core.step_stats

    def describe(self) -> dict:
        """What this cluster runs with: KV transfer and transport, the workers, and each role's engine
        (kernels, linears, KV format, compiled decode, as the first live worker of the role reported)."""
        info: dict[str, Any] = {"model": self.model_name, "kv_transfer": self.kv_transfer,
                                "kv_transport": self.kv_transport, "kv_transfer_dtype": self.kv_transfer_dtype}
        for role in ("prefill", "decode"):
            workers = [w for w in self.workers.workers.values() if w.role == role and not w.fenced]
            info[f"num_{role}_workers"] = len(workers)
            if workers:
                info[f"{role}_engine"] = dict(workers[0].engine)
        return info

    def __repr__(self) -> str:
        return f"DisaggregatedLLM({', '.join(f'{k}={v!r}' for k, v in self.describe().items())})"

    def worker_pids(self) -> dict[str, list[int]]:
        """The pids of the live workers, by role (kill one to watch the others take over)."""
        with self._lock:
            if not self._closed:  # launched workers are judged by their heartbeats: read those that wait
                self.core._pump(0.0)
            return {role: [w.pid for w in self.workers.workers.values() if w.role == role and w.alive]
                    for role in ("prefill", "decode")}

    def shutdown(self) -> None:
        """Stop every worker (killing those that do not stop within 10 s) and free the sockets; idempotent.

        Safe from another thread: it waits for a step under way to end (ZeroMQ sockets are not thread-safe), and
        the calls after it raise that the engine is shut down."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.workers.close()
        with contextlib.suppress(Exception):
            atexit.unregister(self._at_exit)

    def close(self) -> None:
        """The same as :meth:`shutdown` (``LLM``'s name)."""
        self.shutdown()

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    # ------------------------------------------------------------------------- engine-level API
    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Check and send one prompt now; returns its id. Follow it with :meth:`step` (as ``Engine`` is followed)."""
        self._check_open()
        with self._lock:
            return self.engine.add_request(prompt, sampling_params, request_id)

    def step(self, timeout: float = 0.05) -> list[StreamDelta]:
        """Take what the workers sent (waiting up to ``timeout``); return the deltas it produced."""
        self._check_open()
        with self._lock:
            previous, self.core.step_timeout = self.core.step_timeout, timeout
            try:
                return self.engine.step()
            finally:
                self.core.step_timeout = previous  # (an AsyncLLM over this cluster set its own)

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight."""
        return self.engine.has_unfinished_requests()

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool | None = None) -> list:
        """Generate for each prompt across the workers; one ``RequestOutput`` per prompt, in order
        (see :meth:`LLM.generate <minipd.llm_base.LLMBase.generate>`)."""
        self._check_open()
        return super().generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Any:
        """Send ``prompt`` now and return its ``RequestStream``: one ``StreamDelta`` per token as it arrives
        from the workers. Closing the stream (or dropping it) before its last delta aborts the request on
        whichever worker holds it; ``stream.request_id`` can be passed to :meth:`abort`."""
        self._check_open()
        return super().stream(prompt, sampling_params)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is shut down")

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
        with self._lock:
            self.core.inject_fault(worker, fault)

    def worker_stats(self, timeout: float = 10.0) -> dict[str, dict]:
        """Each live worker's KV blocks used and free and its live requests (asked now)."""
        with self._lock:
            return self.core.worker_stats(timeout)


def _shutdown_if_alive(ref: weakref.ref) -> None:
    """At exit: shut down the front end ``ref`` points to, if it still exists."""
    llm = ref()
    if llm is not None:
        llm.shutdown()


__all__ = ["KV_TRANSFERS", "DisaggregatedLLM", "WorkerError"]
