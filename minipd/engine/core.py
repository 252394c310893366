"""The engine core: scheduler, KV pool and model runner behind add / abort / step, on plain data.

The core knows token ids, never text. It takes :class:`~minipd.engine.request.Request` objects
(picklable), and each :meth:`EngineCore.step` returns :class:`~minipd.engine.request.EngineCoreOutputs`
(new token ids, finish reasons, counters). That is what lets the same core run in-process under
:class:`~minipd.llm.LLM`, or in a thread or another process behind queues
(:mod:`minipd.engine.core_client`) for a server, a prefill or decode worker, or an expert-parallel rank;
detokenisation, stop strings and :class:`~minipd.outputs.RequestOutput` live in the front end
(:mod:`minipd.engine.output_processor`).

Each step is a transaction: if the model raises (out of memory, Ctrl-C, a bug), the step's
requests go back to waiting and nothing it half-wrote is ever registered for prefix reuse; what
fails once the step's tokens exist (the eviction press, statistics) is reported after they are
delivered, never instead of them (see :meth:`StepCore.step <minipd.engine.step_core.StepCore.step>`).
The loop itself is :class:`~minipd.engine.step_core.StepCore` (no tensors); this module builds its
parts for a real model and fills its hooks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from minipd.engine.config import EngineConfig
from minipd.engine.eviction import Evictor
from minipd.engine.host_memory import keep_freed_memory
from minipd.engine.model_runner import ModelRunner
from minipd.engine.model_setup import set_linear_backend, set_moe_layers, set_weight_dtype
from minipd.engine.request import Request, RequestStatus
from minipd.engine.run_delay import thread_run_delay
from minipd.engine.scheduler import ScheduledBatch, Scheduler
from minipd.engine.step_core import StepCore
from minipd.engine.threads import SMALL_STEP_TOKENS, StepThreads, threads_for_step
from minipd.kernels.backend import get_backend
from minipd.kernels.measured import measured_choice
from minipd.kv.adaptive import AdaptiveBlockManager, AdaptiveKVPool, adaptive_ratio
from minipd.kv.block_manager import BlockAllocation, BlockManager
from minipd.kv.paged_pool import PackedKV, PagedKVPool
from minipd.kv.press import AttentionTracker, make_press
from minipd.kv.spec import KVSpec
from minipd.models.decoder import DecoderModel
from minipd.models.view import module_view

if TYPE_CHECKING:
    from minipd.engine.compiled_decode import CompiledDecode

logger = logging.getLogger("minipd")

#: Default KV budget on CPU: room for ~85k tokens of tiny-py, and quick to allocate.
CPU_KV_MEMORY = 256 << 20


class EngineCore(StepCore):
    """A continuous-batching engine over a paged KV cache for one model, driven by plain messages.

    The step loop is :class:`~minipd.engine.step_core.StepCore`'s; this class builds the parts it runs
    (the KV pool, the scheduler over it, the :class:`ModelRunner` as executor) from a model and an
    :class:`EngineConfig`, and fills the loop's hooks: K/V imports, CPU thread counts, the eviction press.
    ``clock`` is the loop's clock (``time.perf_counter`` by default).
    """

    def __init__(self, model: DecoderModel, config: EngineConfig, max_model_len: int, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        # The engine's own view of the model (same weight tensors): the linears it packs or quantizes and
        # the MoE settings it makes stay its own, not those of the caller or of another engine on it.
        model = module_view(model)  # type: ignore[assignment]
        self.model = model
        self.config = config
        self.max_model_len = max_model_len
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.kernels = get_backend(config.kernel_backend, self.device)
        #: The model's mixture-of-experts layers, set to the config's backend and settings.
        self.moe_layers = set_moe_layers(model, config)
        #: How the process's C library treats freed memory (CPU engines: kept for the next step, see
        #: :mod:`minipd.engine.host_memory`); None on other devices.
        self.host_memory = keep_freed_memory() if self.device.type == "cpu" else None
        #: Threads a big CPU step gets under ``cpu_threads="auto"`` (torch's count when the engine was built).
        self.default_threads = torch.get_num_threads()
        #: The per-step thread count, held across the steps of a run and given back when it ends.
        self.threads = StepThreads()
        #: Under ``cpu_threads="auto"``, steps of up to this many tokens run on one thread: as measured on this
        #: machine by ``build-kernels``, else the default.
        measured = measured_choice("small_step_tokens", self.default_threads) if self.device.type == "cpu" else None
        self.small_step_tokens = measured if isinstance(measured, int) and measured >= 0 else SMALL_STEP_TOKENS
        set_weight_dtype(model, config.weight_dtype)
        #: Which path the model's linear layers take ("torch" or "onednn"; see :mod:`minipd.kernels.cpu_linear`),
        #: and why (shown by describe()).
        self.linear_backend, self.linear_backend_reason = set_linear_backend(model, config.linear_backend)
        adaptive = config.kv_cache_dtype == "adaptive"
        self.kv_spec = KVSpec.from_name(model.config, config.block_size, "auto" if adaptive else config.kv_cache_dtype,
                                        self.dtype)
        #: With ``kv_cache_dtype="adaptive"``: the format new requests get once the pool is busy.
        self.compressed_spec = KVSpec.from_name(model.config, config.block_size, config.kv_adaptive_format,
                                                self.dtype) if adaptive else None
        # Kernel constraints are checked now, not at the first generate.
        self.kernels.check(self.kv_spec, self.dtype)
        if self.compressed_spec is not None:
            self.kernels.check(self.compressed_spec, self.dtype)
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        self.pool = self._allocate_pool(num_blocks)
        if self.compressed_spec is not None:
            low, high = config.kv_adaptive_thresholds
            self.block_manager: BlockManager | AdaptiveBlockManager = AdaptiveBlockManager(
                num_blocks, config.block_size, adaptive_ratio(self.kv_spec, self.compressed_spec), low, high)
        else:
            self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                              config.scheduling_policy,  # type: ignore[arg-type]
                              make_room=self._compress_one if self.compressed_spec is not None else None)
        #: Keeps each request's K/V within ``kv_budget`` (``kv_eviction``), or None.
        self.evictor = None if config.kv_eviction is None else Evictor(make_press(config.kv_eviction), config,
                                                                       self.kv_spec, self.pool, self.block_manager)
        self.runner = ModelRunner(model, self.pool, self.kernels, config.max_num_batched_tokens,
                                  config.max_num_seqs, max_model_len,
                                  attention_observer=None if self.evictor is None else self.evictor.attention_observer)
        # (Waits for a core are measured on the machine's clock only: a test's clock has none.)
        super().__init__(scheduler, self.runner, max_model_len, clock=clock, stats_history=config.stats_history,
                         run_delay=thread_run_delay if clock is time.perf_counter else None)
        #: Whether decode steps are compiled, and why (``compile_decode="auto"`` resolved): for describe().
        self.compile_choice = self._choose_compile()
        if self.compile_choice[0]:
            self.runner.compiled = self._compile_decode(max_model_len)
        self._imports: dict[str, PackedKV] = {}
        self._reservations: dict[str, BlockAllocation] = {}
        #: A step whose eviction failed (done again before the next step), and the error kept for the caller.
        self._pending_eviction: ScheduledBatch | None = None

    def _choose_compile(self) -> tuple[bool, str]:
        """``compile_decode`` resolved: (on, why). ``"auto"`` compiles a long-lived engine whose configuration
        the compiled step covers, and says what kept it off otherwise; ``True`` refuses what it cannot cover."""
        setting = self.config.compile_decode
        if setting is not True and setting != "auto":
            return False, "asked for"
        config = self.config
        gap = (None if not self.moe_layers else
               "moe_capacity_factor (drops by capacity)" if config.moe_capacity_factor is not None else
               "record_routing" if config.record_routing else
               "moe_backend='triton'" if config.moe_backend == "triton" else None)
        if setting is True:  # (remote experts were refused by EngineConfig already)
            if gap is not None:
                raise ValueError(f"compile_decode does not cover {gap}: pass compile_decode=False")
            return True, "asked for"
        uncovered = gap or ("experts in other processes" if config.expert_parallel_size > 1 else None)
        if uncovered is not None:
            return False, f"auto: the compiled step does not cover {uncovered}"
        if not self.config.long_lived:
            return False, "auto: a short-lived engine (long_lived=False); compile_decode=True compiles"
        if self.device.type != "cpu":
            # Captured CUDA graphs must not be built beside running steps: compile them at start, when asked.
            return False, "auto: on a GPU pass compile_decode=True (with compile_warmup=True to compile at start)"
        if not self._compiled_attention_is_the_kernel():
            return False, ("auto: the torch attention needs a program per table width; the C++ kernel "
                           "(python -m minipd build-kernels; fp32 model and cache) needs one per batch size")
        return True, "auto: a long-lived engine"

    def _compiled_attention_is_the_kernel(self) -> bool:
        # (An adaptive pool's compressed rows are read by the torch attention: its programs are per table width.)
        floats = (torch.float32, torch.bfloat16, torch.float16)
        return (self.kernels.name == "cpu" and self.kv_spec.dtype in floats and self.dtype in floats
                and self.kv_spec.quant is None and not self.kv_spec.latent and self.config.kv_cache_dtype != "adaptive")

    def _compile_decode(self, max_model_len: int) -> CompiledDecode:
        """The compiled decode step of ``compile_decode=True`` (warmed up now with ``compile_warmup``).

        Attention is the C++ kernel (a dispatcher op the compiler calls whole) with the CPU backend, else the
        static-shape torch reference, which a GPU captures in its CUDA graph.
        """
        from minipd.engine.compiled_decode import (
            CompiledDecode,
            bucket_sizes,
            cpu_decode_attention,
            decode_attention_with_new,
        )
        from minipd.kernels.cpu_linear import TRACED_SUM_ROWS

        # (What it does not cover was refused or turned off by _choose_compile.)
        # The C++ kernel reads fp32, bf16 and fp16 per-head pools up to each length (no need to bucket the table's
        # width); per-token codes and MLA's latents go through torch attention that gathers the whole (bucketed)
        # width and decodes what it gathers.
        kernel = self._compiled_attention_is_the_kernel()
        attend = cpu_decode_attention if kernel else decode_attention_with_new
        # A compiled MoE step runs every expert on every row (StackedExperts.every_expert): it pays up to the
        # rows a multiply-and-sum serves (16); bigger decode batches of an MoE model run eagerly, by expert.
        largest = self.config.max_num_seqs if not self.moe_layers else min(self.config.max_num_seqs, TRACED_SUM_ROWS)
        sizes = self.config.compile_batch_sizes or bucket_sizes(largest)
        watched = self.evictor is not None and self.evictor.tracker is not None  # eviction by received attention
        cpu = self.device.type == "cpu"
        # A long-lived engine's programs get a C++ wrapper: a faster step for a longer compile (in the background).
        compiled = CompiledDecode(self.model, self.pool, attend, sizes, -(-max_model_len // self.config.block_size),
                                  width_buckets=not kernel, keep_queries=watched,
                                  cpp_wrapper=cpu and self.config.long_lived)
        if self.config.compile_warmup:
            compiled.warm_up(threads=(lambda rows: self._compiled_threads()) if cpu else None)
        elif self.config.compile_decode == "auto":
            compiled.compile_in_background(self._compiled_threads() if cpu else None)
        return compiled

    def _compiled_threads(self) -> int:
        """Threads a compiled decode step runs on: all of them under ``cpu_threads="auto"``.

        One thread wins small *eager* steps because each of their dozens of small ops pays the threads'
        fork and join; a compiled step is a handful of fused loops, and its linears are written as sums the
        compiler splits over the threads (on the 2-core EPYC, one stream: 1.2 ms a token on two threads,
        2.3 ms on one). Every bucket uses the same count, so none is traced twice."""
        return self.default_threads if self.config.cpu_threads == "auto" else int(self.config.cpu_threads)

    def _describe_compile(self) -> str:
        compiled, (on, why) = self.runner.compiled, self.compile_choice
        if compiled is None:
            return "off" if why == "asked for" else f"off ({why})" if not on else "off (the compiler refused a program)"
        what = f"{len(compiled.batch_sizes)} batch sizes"
        if compiled.ready is not None:
            what += f", {len(compiled.ready)} of {compiled.num_buckets} programs ready"
            if compiled.compiling:
                what += ", compiling in the background"
        if compiled.loaded:
            what += f", {len(compiled.loaded)} loaded from disk"
        return f"on ({what}{'' if why == 'asked for' else '; ' + why})"

    def describe(self) -> dict:
        """What this engine actually runs with (after "auto" choices and fallbacks): kernels, linears, KV
        format and pool, compiled decode, MoE path."""
        dtype = str(self.dtype).removeprefix("torch.")
        info = {"device": str(self.device), "dtype": dtype,
                "kernel_backend": self.kernels.name, "linear_backend": self.linear_backend,
                "linear_backend_reason": self.linear_backend_reason,
                "weight_dtype": "int8" if self.config.weight_dtype == "int8" else dtype,
                "kv_cache_dtype": (self.config.kv_cache_dtype if self.config.kv_cache_dtype != "auto"
                                   else str(self.kv_spec.dtype).removeprefix("torch.")),
                "num_kv_blocks": self.block_manager.num_blocks, "block_size": self.config.block_size,
                "compile_decode": self._describe_compile(),
                "scheduling_policy": self.scheduler.policy.name, "cpu_threads": self.config.cpu_threads}
        if self.device.type == "cpu" and self.config.cpu_threads == "auto":
            info["one_thread_up_to_tokens"] = self.small_step_tokens
        if self.host_memory is not None:
            info["host_memory"] = self.host_memory
        if self.moe_layers:
            info["moe_backend"] = self.config.moe_backend
        if self.press is not None:
            info["kv_eviction"] = type(self.press).__name__
        return info

    @property
    def num_residual_slots(self) -> int:
        """Full-precision blocks a KIVI pool keeps for filling blocks: one per running sequence."""
        return self.config.max_num_seqs if self.kv_spec.has_residual_window else 0

    def _default_num_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] // 2
        else:
            budget = CPU_KV_MEMORY
        if self.compressed_spec is not None:  # pages: a full-precision block and its parts' scales each
            blocks = max(1, budget // AdaptiveKVPool.page_bytes(self.kv_spec, self.compressed_spec))
        else:
            window = PagedKVPool.residual_bytes(self.kv_spec, self.num_residual_slots, self.dtype)
            blocks = self.kv_spec.blocks_for_budget(max(0, budget - window))
        if cfg.kv_cache_memory is not None:
            return blocks
        # More than every running sequence at full length can use would only waste memory.
        return min(blocks, cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size))

    def _allocate_pool(self, num_blocks: int) -> PagedKVPool:
        try:
            if self.compressed_spec is not None:
                return AdaptiveKVPool(self.kv_spec, num_blocks, self.device, self.compressed_spec)
            return PagedKVPool(self.kv_spec, num_blocks, self.device, self.num_residual_slots, self.dtype)
        except (RuntimeError, MemoryError) as err:  # torch reports a failed allocation as RuntimeError
            field = "num_kv_blocks" if self.config.num_kv_blocks else "kv_cache_memory"
            need = num_blocks * self.kv_spec.bytes_per_block
            raise ValueError(f"cannot allocate a KV pool of {num_blocks} blocks x block_size "
                             f"{self.config.block_size} ({need / 2**20:.1f} MiB) on {self.device}: lower "
                             f"{field} or block_size ({type(err).__name__}: {str(err).splitlines()[0]})") from None

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens of K/V the pool holds."""
        return self.pool.num_tokens

    # ---------------------------------------------------------------------------------- requests
    def add_request(self, request: Request, kv: PackedKV | None = None) -> None:
        """Queue a request. With ``kv``, its first ``request.num_external_tokens`` tokens' K/V are given.

        A request with ``num_external_tokens`` but no ``kv`` waits, holding its blocks, until
        :meth:`import_kv` or :meth:`finish_kv_load` says they arrived.
        """
        self._accept(request, kv)
        if kv is not None:
            self._imports[request.request_id] = kv
        self.scheduler.add(request)

    def _accept(self, request: Request, kv: PackedKV | None = None) -> None:
        """Check a new request (and the K/V given with it) and make it live."""
        if kv is not None:
            if kv.num_blocks != -(-kv.num_tokens // self.config.block_size):
                raise ValueError(f"the KV given has {kv.num_blocks} blocks for {kv.num_tokens} tokens of "
                                 f"block_size {self.config.block_size}")
            if kv.num_tokens != request.num_external_tokens:
                raise ValueError(f"the KV given holds {kv.num_tokens} tokens but num_external_tokens is "
                                 f"{request.num_external_tokens}")
            if kv.spec != self.kv_spec:
                raise ValueError(f"KV format mismatch: given {kv.spec.to_dict()}, this engine stores "
                                 f"{self.kv_spec.to_dict()}")
        super()._accept(request)

    # ---------------------------------------------------------------------------- reservations
    def reserve_blocks(self, key: str, num_tokens: int) -> list[int] | None:
        """Set aside blocks for ``num_tokens`` tokens of K/V that a peer will write (push transfers).

        Returns their ids, or None when the pool has no room now. :meth:`add_reserved` later hands
        them to the request they were for; :meth:`release_reservation` gives them back.
        """
        if key in self._reservations:
            raise ValueError(f"reservation {key!r} exists already")
        alloc = BlockAllocation()
        if not self.block_manager.allocate(alloc, num_tokens):
            return None
        self._reservations[key] = alloc
        return list(alloc.block_table)

    def release_reservation(self, key: str) -> bool:
        """Give back reserved blocks that no request took; False if there is no such reservation."""
        alloc = self._reservations.pop(key, None)
        if alloc is None:
            return False
        self.block_manager.free_blocks(alloc)
        return True

    def add_reserved(self, request: Request, key: str) -> None:
        """Queue a request whose first ``num_external_tokens`` tokens' K/V were written into reservation ``key``."""
        alloc = self._reservations.get(key)
        if alloc is None:
            raise ValueError(f"no reservation {key!r}")
        needed = -(-request.num_external_tokens // self.config.block_size)
        if not 0 < request.num_external_tokens < request.num_tokens or needed > len(alloc.block_table):
            raise ValueError(f"reservation {key!r} holds {len(alloc.block_table)} blocks; the request needs "
                             f"{needed} for num_external_tokens={request.num_external_tokens}")
        self._accept(request)
        request.blocks = self._reservations.pop(key)
        self.scheduler.add_with_kv(request)

    # ---------------------------------------------------------------------------- KV in and out
    def kv_blocks_of(self, request_id: str) -> list[int]:
        """The block table of a live request (where its K/V are, or where arriving K/V must go)."""
        return list(self._live(request_id).blocks.block_table)

    def import_kv(self, request_id: str, kv: PackedKV) -> None:
        """Write K/V received for a request that waits for them, and let it compute the rest."""
        request = self._waiting_for_kv(request_id)
        if kv.num_tokens != request.num_external_tokens:
            raise ValueError(f"the KV given holds {kv.num_tokens} tokens but the request waits for "
                             f"{request.num_external_tokens}")
        self.pool.import_blocks(request.blocks.block_table[:kv.num_blocks], kv)
        self.scheduler.kv_arrived(request_id)

    def finish_kv_load(self, request_id: str) -> None:
        """K/V for the request were written straight into its blocks (e.g. by NIXL): let it compute the rest."""
        self._waiting_for_kv(request_id)
        self.scheduler.kv_arrived(request_id)

    def export_kv(self, request_id: str, num_tokens: int | None = None) -> PackedKV:
        """Pack the K/V of a request's first ``num_tokens`` computed tokens (all by default)."""
        request = self._live(request_id)
        computed = request.num_computed_tokens
        num_tokens = computed if num_tokens is None else num_tokens
        if not 0 < num_tokens <= computed:
            raise ValueError(f"num_tokens must be in [1, {computed}] (tokens with K/V), got {num_tokens}")
        if request.blocks.num_dropped_tokens:
            raise ValueError(f"request {request_id!r} dropped blocks (token eviction): its K/V no longer "
                             "line up with its tokens")
        if self.compressed_spec is not None:
            raise ValueError("K/V of an adaptive pool (kv_cache_dtype='adaptive') cannot be exported yet")
        blocks = -(-num_tokens // self.config.block_size)
        packed = self.pool.export_blocks(request.blocks.block_table[:blocks], num_tokens)
        filled = num_tokens % self.config.block_size
        if self.runner.residual is not None and filled:  # a KIVI tail: its exact rows, not just its codes
            packed.tail = self.runner.residual.rows_of(request, request.blocks.block_table[blocks - 1], filled)
        return packed

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_kv`` request kept; False if it holds none."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.FINISHED_HOLDING_KV:
            return False
        del self.requests[request_id]
        return self.scheduler.release_kv(request_id)

    def _live(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no live request {request_id!r}")
        return request

    def _waiting_for_kv(self, request_id: str) -> Request:
        request = self._live(request_id)
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {request.status.value}, not waiting for KV")
        return request

    # -------------------------------------------------------------------------------------- step
    def set_layer_hook(self, hook: Callable[[ScheduledBatch, int], None] | None) -> None:
        """Call ``hook(batch, layer)`` once each layer's K/V of a step are stored (layer-wise KV transfer
        posts them while the next layer computes); None removes it. Steps run eagerly while one is set."""
        self.runner.layer_hook = hook

    # ------------------------------------------------------------------------- the step's hooks
    # The step itself is StepCore.step. A failure of the eviction press (it runs once the step's tokens
    # exist, since it scores the K/V the step wrote) is kept, not raised: the eviction is done again first
    # thing next step, before anything computes, so the run goes on exactly as if it had not failed. If it
    # fails again it is skipped (the blocks are kept, and later steps evict what each request still holds
    # over its budget): a press that keeps failing costs memory, never tokens, and never stalls the engine.
    def _before_step(self) -> None:
        if self._pending_eviction is not None:
            batch, self._pending_eviction = self._pending_eviction, None
            try:
                self._evict(batch)
            except Exception as err:
                # Failed twice: give it up rather than stall every step behind a press that keeps failing.
                self._keep_failure(err, "the eviction press failed again; this eviction is skipped")
            except BaseException:
                self._pending_eviction = batch  # interrupted (Ctrl-C): still owed, done first next step
                raise

    def _with_arrivals(self, batch: ScheduledBatch) -> ScheduledBatch:
        if self._apply_imports() and not batch:
            # The K/V just imported let those requests compute now.
            first, batch = batch, self.scheduler.schedule()
            batch.preempted[:0] = first.preempted
        if self._imports and batch:
            # K/V handed over for a prefix the local cache already had are not needed: let them go.
            for request, _ in batch.entries:
                self._imports.pop(request.request_id, None)
        return batch

    def _enter_step(self, batch: ScheduledBatch) -> None:
        compiled = self.runner.compiled
        if compiled is not None:
            compiled.idle.clear()  # (a background compilation waits for the run to end)
        if self.device.type == "cpu":
            bucket = self.runner.compiled_bucket(batch)
            self.threads.enter(self._compiled_threads() if bucket is not None else
                               threads_for_step(self.config.cpu_threads, batch.num_tokens, self.default_threads,
                                                self.small_step_tokens))

    def _leave_step(self) -> None:
        self.threads.restore()

    def _after_tokens(self, batch: ScheduledBatch) -> None:
        if self.evictor is not None:
            try:
                self._evict(batch)
            except Exception as err:
                self._pending_eviction = batch
                self._keep_failure(err, "the eviction press failed; it runs again before the next step")

    def _extra_stats(self) -> dict:
        return {**self._adaptive_stats(), **self._routing_stats()}

    def _run_ended(self) -> None:
        self.threads.restore()  # the run is over: the caller's thread count is back
        if self.runner.compiled is not None:
            self.runner.compiled.idle.set()

    def _forget(self, request_id: str) -> None:
        self._imports.pop(request_id, None)

    def _compress_one(self) -> bool:
        """Compress the running full-precision request holding the most blocks; False if there is none."""
        candidates = [r for r in self.scheduler.running if r.blocks.compressed is False and r.blocks.block_table]
        if not candidates:
            return False
        request = max(reversed(candidates), key=lambda r: len(r.blocks.block_table))  # ties: the newest
        pages, parts = self.block_manager.compress(request.blocks)  # type: ignore[union-attr]
        self.pool.compress_pages(pages, parts)  # type: ignore[attr-defined]
        return True

    def _routing_stats(self) -> dict:
        """This step's routing per MoE layer (summed over the layer's calls), when recorded."""
        if not self.config.record_routing or not self.moe_layers:
            return {}
        counts, entropy = [], []
        for layer in self.moe_layers:
            log, layer.routing_log = layer.routing_log or [], []
            total = sum((c for c, _ in log), torch.zeros(layer.router.num_experts, dtype=torch.int64))
            tokens = [int(c.sum()) for c, _ in log]
            counts.append(tuple(total.tolist()))
            # Calls weighted by their tokens (one call per step, unless the step is split in micro-batches).
            entropy.append(sum(e * n for (_, e), n in zip(log, tokens, strict=True)) / max(1, sum(tokens)))
        return {"expert_counts": tuple(counts), "router_entropy": tuple(entropy)}

    def _adaptive_stats(self) -> dict:
        bm = self.block_manager
        if not isinstance(bm, AdaptiveBlockManager):
            return {}
        return {"kv_usage": bm.usage, "kv_compressing": bm.compressing, "kv_format_switches": bm.num_switches,
                "num_compressed_running": sum(1 for r in self.scheduler.running if r.blocks.compressed),
                "kv_compressions": bm.num_compressions}

    def _evict(self, batch: ScheduledBatch) -> None:
        """Drop what the step's requests hold over their budget (see :class:`~minipd.engine.eviction.Evictor`)."""
        self.evictor.evict(batch, self.requests)  # type: ignore[union-attr]

    @property
    def press(self) -> Any:
        """The eviction press (``kv_eviction``), or None."""
        return None if self.evictor is None else self.evictor.press

    @property
    def attention_tracker(self) -> AttentionTracker | None:
        """What the attention-scoring presses read (None for the others)."""
        return None if self.evictor is None else self.evictor.tracker

    @property
    def num_evicted_blocks(self) -> int:
        """Blocks given back by the press so far."""
        return 0 if self.evictor is None else self.evictor.num_evicted_blocks

    @property
    def num_evicted_tokens(self) -> int:
        """Tokens dropped by token-level eviction so far."""
        return 0 if self.evictor is None else self.evictor.num_evicted_tokens

    def _apply_imports(self) -> bool:
        """Write the K/V given with requests whose blocks are allocated; True if any arrived.

        An import that fails (out of memory, say) stays pending and is tried again next step.
        """
        arrived = False
        for request_id in [r for r in self._imports if r in self.scheduler.waiting_for_kv]:
            kv = self._imports[request_id]
            waiting = self.scheduler.waiting_for_kv[request_id]
            self.pool.import_blocks(waiting.blocks.block_table[:kv.num_blocks], kv)
            if kv.tail is not None and self.runner.residual is not None:
                self.runner.residual.adopt(waiting, waiting.blocks.block_table[kv.num_blocks - 1], kv.tail)
            del self._imports[request_id]
            self.scheduler.kv_arrived(request_id)
            arrived = True
        return arrived
