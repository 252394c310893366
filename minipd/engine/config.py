"""The engine's knobs, checked once, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from types import SimpleNamespace

from minipd.errors import ParameterError
from minipd.sampling_params import is_integer, is_real

#: What ``linear_backend`` accepts (see :class:`EngineConfig`).
LINEAR_BACKENDS = ("auto", "torch", "onednn", "cpu")


@dataclass
class EngineConfig:
    """How the engine sizes its KV pool and schedules work.

    Every field is checked when the config is built, before a model is loaded: a bad value is a
    :class:`~minipd.errors.ParameterError` (a ``ValueError``) naming the field and what it allows. The
    fields fall in groups (:data:`GROUPS`: scheduler, cache, kernels, compile, moe, snapshots): ``LLM``
    takes them flat or by group (``cache={"block_size": 32}``), and ``config.cache.block_size`` reads one
    back. Bools are refused where integers are
    expected (Python would read True as 1); NumPy integers are stored as plain ints.

    Args:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool; when None, sized from ``kv_cache_memory``.
        kv_cache_memory: bytes for K and V; when None, 256 MiB on CPU or half the free GPU memory,
            and never more than ``max_num_seqs`` full-length sequences need. A float with no
            fractional part (``4e9``) is accepted as that many bytes; any other float is refused.
        max_num_batched_tokens: token budget of one step, shared by decodes and prefill chunks.
        max_num_seqs: most requests running at once.
        enable_prefix_caching: reuse the KV blocks of prompts' common prefixes (True or False).
        scheduling_policy: ``"decode-first"`` (``"fcfs"``), ``"prefill-first"`` or ``"prefill-only"``
            (steps are all prefill or all decode, vLLM's scheduler of 2023), or an instance of
            :class:`~minipd.engine.scheduler.SchedulingPolicy`.
        kernel_backend: ``"torch"``, ``"triton"`` or ``"cpu"`` (the compiled C++ paged-attention kernels of
            :mod:`minipd.kernels.cpu_paged_attention`, and for fp32 eager steps the one-pass RMSNorm, RoPE and
            SwiGLU activation of :mod:`minipd.kernels.cpu_norm_rope`, equal to torch's up to rounding); None
            picks Triton on CUDA, and on a CPU the C++ kernels once they are built (``make install`` builds
            them), torch before.
        linear_backend: how the model's linear layers multiply: ``"torch"`` (``F.linear``), ``"onednn"``
            (weights packed once for oneDNN's CPU kernels), ``"cpu"`` (weights packed in panels for minipd's
            C++ kernel, built with the attention kernels) — both fp32 on a CPU only; see
            :mod:`minipd.kernels.cpu_linear` — or ``"auto"``: the fastest of them measured on this machine
            (``python -m minipd build-kernels``); not measured, the C++ kernel where it is built, else oneDNN.
        weight_dtype: ``"auto"`` (the model's dtype) or ``"int8"``: weight-only int8 linears with a scale per
            output row, multiplied in bf16 (:mod:`minipd.kernels.int8_linear`); it changes the model's
            numbers (see ``python -m minipd kvquality --methods weights-int8``). The LLM's model is changed in place.
        cpu_threads: threads a CPU step runs on: ``"auto"`` (one for steps of up to 4 tokens, where a second
            thread costs more than it brings, torch's thread count for bigger ones; see
            :mod:`minipd.engine.threads`) or a fixed positive count.
        compile_decode: run pure-decode steps through a compiled static-shape program, one per (batch,
            block-table width) bucket (:mod:`minipd.engine.compiled_decode`; ``torch.compile``, and on a GPU a
            CUDA graph). Dense, MoE and MLA models (MoE: local experts, no capacity bound, no routing record;
            up to 16 rows a step), plain or per-token quantized caches (not KIVI's ``"int4"`` or
            ``"adaptive"``), with or without an eviction press. ``True``: each bucket
            compiles on first use (seconds to tens of seconds on a laptop CPU, the step waiting for it);
            ``"auto"`` (the default): on for a ``long_lived`` engine whose configuration it covers and whose
            attention is the C++ kernel (one program per batch size), compiled in the background while steps
            run eagerly until their bucket is ready, and off for any other engine (a notebook's engine is gone
            before the compiler pays back); ``False``: off. What was chosen, and why, is in
            ``describe()`` and the engine's repr.
        compile_warmup: with ``compile_decode``, compile every bucket when the engine starts instead of on
            first use (or in the background).
        long_lived: this engine serves for long (``python -m minipd serve`` and the bench set it): what
            ``compile_decode="auto"`` reads; on a CPU its programs also get a C++ wrapper (a faster step for
            a longer compile).
        compile_batch_sizes: the batch buckets (None: 1, 2, 4, 8, 12, then multiples of 8 up to ``max_num_seqs``);
            a decode step of more sequences than the largest runs eagerly.
        moe_backend: how a mixture-of-experts model runs its experts: ``"loop"`` (one matmul pair per
            expert, the reference), ``"grouped_mm"`` (rows sorted by expert, ``torch._grouped_mm``),
            ``"triton"`` (the fused kernel of :mod:`minipd.kernels.fused_moe`) or ``"auto"`` (grouped
            where native on CUDA, else the loop). It sets the model's MoE layers.
        moe_capacity_factor: bound every expert's load per step at this multiple of an even share (None:
            no bound); ``moe_overflow`` says what happens to assignments over it: ``"drop"`` or
            ``"reroute"`` (to the token's next-best expert with room). See :mod:`minipd.moe.capacity`.
        router_dtype: route with the gate weights rounded to ``"int8"`` or ``"int4"`` (one scale per expert),
            or as stored (``"auto"``).
        moe_dispatch_dtype: round the rows sent to the routed experts to ``"int8"`` or ``"fp8"`` with a
            scale per token, as a compressed all-to-all would carry them, or not (``"auto"``).
        expert_parallel_size: spread every MoE layer's experts over this many processes (1: all here).
            Rank 0 is the engine's process; the others are spawned and serve their experts, with
            tokens sent to them and back by all-to-all (see :mod:`minipd.moe.expert_parallel`).
        expert_parallel_timeout: seconds a layer's collectives may take before a rank counts as gone.
        expert_parallel_overlap: split each layer's tokens in two micro-batches and overlap one's
            communication with the other's experts (False: one batch, each collective waited for).
        record_routing: keep each step's routing per MoE layer (tokens per expert, top-k weight entropy)
            in the step stats (costs a device-to-host copy per MoE layer per step).
        kv_cache_dtype: how K/V are stored: ``"auto"`` (the model's dtype), ``"float32"``,
            ``"float16"`` (``"fp16"``) or ``"bfloat16"`` (``"bf16"``) — independent of the model's
            dtype — or quantized with scales: ``"int8"`` or ``"fp8"`` (e4m3), a scale per token per KV
            head; ``"int4_per_token"``; ``"int4"`` (KIVI: K per channel per block, V per token, the
            filling block in full precision). An 8-bit pool holds about twice the tokens of an fp16 one in
            the same memory. ``"adaptive"``: the model's dtype while the pool has room, then
            ``kv_adaptive_format`` for new requests (see :mod:`minipd.kv.adaptive`; needs
            ``enable_prefix_caching=False``).
        kv_adaptive_format: the compressed format of ``"adaptive"``: ``"int8"``, ``"fp8"`` or
            ``"int4_per_token"``.
        kv_adaptive_thresholds: ``(low, high)`` pool usage: new requests are compressed once usage
            reaches ``high``, and get full precision again once it falls below ``low``.
        kv_eviction: keep each request's K/V within ``kv_budget`` tokens by dropping whole blocks:
            ``"sink-window"``, ``"knorm"``, ``"h2o"``, ``"snapkv"``, ``"random"`` or a
            :class:`~minipd.kv.press.KVPress`;
            None (the default) keeps everything.
        kv_budget: tokens of K/V a request keeps with ``kv_eviction`` (at least two blocks); it holds
            up to one block more, since blocks are given back whole.
        kv_eviction_granularity: ``"block"`` (the press ranks whole blocks and whole blocks are dropped)
            or ``"token"`` (it ranks single tokens; the kept ones are compacted into fewer blocks).
        stats_history: how many recent steps' :class:`~minipd.engine.stats.StepStats` the engine
            keeps (older ones are dropped, so a long-running service does not grow).
        snapshot_interval: save a resumable snapshot every this many steps (None: never); needs
            ``snapshot_path``, the folder it is written to (replaced whole each time).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    scheduling_policy: object = "decode-first"
    kernel_backend: str | None = None
    linear_backend: str = "auto"
    weight_dtype: str = "auto"
    cpu_threads: int | str = "auto"
    compile_decode: bool | str = "auto"
    compile_warmup: bool = False
    long_lived: bool = False
    compile_batch_sizes: tuple[int, ...] | None = None
    moe_backend: str = "auto"
    moe_capacity_factor: float | None = None
    moe_overflow: str = "drop"
    router_dtype: str = "auto"
    moe_dispatch_dtype: str = "auto"
    expert_parallel_size: int = 1
    expert_parallel_timeout: float = 60.0
    expert_parallel_overlap: bool = True
    record_routing: bool = False
    kv_cache_dtype: str = "auto"
    kv_adaptive_format: str = "int8"
    kv_adaptive_thresholds: tuple[float, float] = (0.5, 0.7)
    kv_eviction: object = None
    kv_budget: int | None = None
    kv_eviction_granularity: str = "block"
    stats_history: int = 10_000
    snapshot_interval: int | None = None
    snapshot_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ParameterError(name, f"{name} must be a positive integer, got {value!r}")
            setattr(self, name, int(value))
        if self.num_kv_blocks is not None:
            if not is_integer(self.num_kv_blocks) or self.num_kv_blocks < 1:
                raise ParameterError("num_kv_blocks",
                                     f"num_kv_blocks must be a positive integer or None, got {self.num_kv_blocks!r}")
            self.num_kv_blocks = int(self.num_kv_blocks)
        if self.kv_cache_memory is not None:
            memory = self.kv_cache_memory
            # 4e9 is how people write byte counts; accept floats that are whole numbers, nothing fractional.
            whole = is_integer(memory) or (is_real(memory) and float(memory).is_integer())
            if not whole or memory < 1:
                raise ParameterError("kv_cache_memory",
                                     f"kv_cache_memory must be None or a positive whole number of bytes, "
                                     f"got {memory!r}")
            self.kv_cache_memory = int(memory)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ParameterError("enable_prefix_caching",
                                 f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        self._check_policy()
        self._check_backend()
        self._check_moe()
        from minipd.kv.spec import KV_CACHE_DTYPES as kv_dtypes

        if self.kv_cache_dtype not in (*kv_dtypes, "adaptive"):
            raise ParameterError("kv_cache_dtype",
                                 f"kv_cache_dtype must be one of {', '.join(repr(d) for d in kv_dtypes)} or "
                                 f"'adaptive', got {self.kv_cache_dtype!r}")
        self._check_eviction()
        self._check_adaptive()
        self._check_compile()
        if not is_integer(self.stats_history) or self.stats_history < 1:
            raise ParameterError("stats_history",
                                 f"stats_history must be a positive integer (steps kept), got {self.stats_history!r}")
        if self.snapshot_interval is not None:
            if not is_integer(self.snapshot_interval) or self.snapshot_interval < 1:
                raise ParameterError("snapshot_interval",
                                     f"snapshot_interval must be None or a positive number of steps, "
                                     f"got {self.snapshot_interval!r}")
            if not isinstance(self.snapshot_path, (str, os.PathLike)) or not str(self.snapshot_path):
                raise ParameterError("snapshot_interval",
                                     "snapshot_interval needs snapshot_path, the folder to write snapshots to, "
                                     f"got {self.snapshot_path!r}")

    def _check_eviction(self) -> None:
        from minipd.kv.press import make_press

        # Checked whether or not a press is set: a typo here would otherwise wait for the day one is.
        if self.kv_eviction_granularity not in ("block", "token"):
            raise ParameterError("kv_eviction_granularity", "kv_eviction_granularity must be 'block' or 'token', "
                                                            f"got {self.kv_eviction_granularity!r}")
        if self.kv_eviction is None:
            if self.kv_budget is not None:
                raise ParameterError("kv_budget",
                                     "kv_budget needs kv_eviction (which press drops the blocks), got kv_eviction=None")
            return
        make_press(self.kv_eviction)  # names the choices when it is not one
        if self.kv_eviction_granularity == "token" and self.kv_cache_dtype == "int4":
            raise ParameterError("kv_eviction_granularity",
                                 "kv_eviction_granularity='token' moves single tokens between blocks, which KIVI's "
                                 "int4 cannot (a block's keys share per-channel scales); use 'block' or another format")
        if not is_integer(self.kv_budget) or self.kv_budget < 2 * self.block_size:
            raise ParameterError("kv_budget",
                                 f"kv_budget must be an integer of at least two blocks ({2 * self.block_size} tokens) "
                                 f"with kv_eviction, got {self.kv_budget!r}")
        self.kv_budget = int(self.kv_budget)

    def _check_moe(self) -> None:
        from minipd.moe.experts import IMPLEMENTATIONS

        if self.moe_backend not in IMPLEMENTATIONS:
            raise ParameterError("moe_backend", f"moe_backend must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
                                                f"got {self.moe_backend!r}")
        factor = self.moe_capacity_factor
        if factor is not None and (not is_real(factor) or not factor > 0):
            raise ParameterError("moe_capacity_factor",
                                 f"moe_capacity_factor must be None or a positive number, got {factor!r}")
        choices = {"moe_overflow": ("drop", "reroute"), "router_dtype": ("auto", "int8", "int4"),
                   "moe_dispatch_dtype": ("auto", "int8", "fp8")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ParameterError(name,
                                     f"{name} must be one of {', '.join(map(repr, allowed))}, "
                                     f"got {getattr(self, name)!r}")
        if not isinstance(self.record_routing, bool):
            raise ParameterError("record_routing", f"record_routing must be True or False, got {self.record_routing!r}")
        self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        size = self.expert_parallel_size
        if not is_integer(size) or size < 1:
            raise ParameterError("expert_parallel_size",
                                 f"expert_parallel_size must be a positive integer, got {size!r}")
        self.expert_parallel_size = int(size)
        timeout = self.expert_parallel_timeout
        if not is_real(timeout) or not timeout > 0:
            raise ParameterError("expert_parallel_timeout",
                                 f"expert_parallel_timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(self.expert_parallel_overlap, bool):
            raise ParameterError("expert_parallel_overlap",
                                 f"expert_parallel_overlap must be True or False, got {self.expert_parallel_overlap!r}")
        if size > 1 and self.moe_capacity_factor is not None:
            raise ParameterError("moe_capacity_factor",
                                 "moe_capacity_factor needs all experts in one process: "
                                 "use it with expert_parallel_size=1")
        if size > 1 and self.moe_backend == "triton":
            raise ParameterError("moe_backend",
                                 "moe_backend='triton' fuses the token permutation with local experts; with "
                                 "expert_parallel_size > 1 use 'loop', 'grouped_mm' or 'auto'")

    def _check_compile(self) -> None:
        if not (isinstance(self.compile_decode, bool) or self.compile_decode == "auto"):
            raise ParameterError("compile_decode",
                                 f"compile_decode must be True, False or 'auto', got {self.compile_decode!r}")
        for name in ("compile_warmup", "long_lived"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        sizes = self.compile_batch_sizes
        if sizes is not None:
            if (not isinstance(sizes, (tuple, list)) or not sizes
                    or not all(is_integer(n) and 0 < n <= self.max_num_seqs for n in sizes)):
                raise ParameterError("compile_batch_sizes",
                                     f"compile_batch_sizes must be None or a non-empty list of batch sizes between 1 "
                                     f"and max_num_seqs ({self.max_num_seqs}), got {sizes!r}")
            self.compile_batch_sizes = tuple(sorted({int(n) for n in sizes}))
        if self.compile_warmup and self.compile_decode is False:
            raise ParameterError("compile_warmup",
                                 "compile_warmup compiles the decode buckets of compile_decode: "
                                 "pass compile_decode=True")
        if self.compile_decode is True and self.expert_parallel_size > 1:
            # Refused here, before any rank process starts: the compiled step has no expert-parallel layers.
            raise ParameterError("compile_decode",
                                 "compile_decode covers models whose experts are all in this process; with "
                                 "expert_parallel_size > 1 pass compile_decode=False")

    def _check_adaptive(self) -> None:
        from minipd.kv.quant import PER_TOKEN_FORMATS as formats

        if self.kv_adaptive_format not in formats:
            raise ParameterError("kv_adaptive_format",
                                 f"kv_adaptive_format must be one of {', '.join(map(repr, formats))}, "
                                 f"got {self.kv_adaptive_format!r}")
        thresholds = self.kv_adaptive_thresholds
        if not (isinstance(thresholds, (tuple, list)) and len(thresholds) == 2 and all(map(is_real, thresholds))
                and 0 <= thresholds[0] <= thresholds[1] <= 1):
            raise ParameterError("kv_adaptive_thresholds",
                                 f"kv_adaptive_thresholds must be (low, high) with 0 <= low <= high <= 1, "
                                 f"got {thresholds!r}")
        self.kv_adaptive_thresholds = (float(thresholds[0]), float(thresholds[1]))
        if self.kv_cache_dtype != "adaptive":
            return
        if self.enable_prefix_caching:
            raise ParameterError("kv_cache_dtype",
                                 "kv_cache_dtype='adaptive' does not share prefix blocks between formats yet: "
                                 "pass enable_prefix_caching=False with it")
        if self.kv_eviction is not None:
            raise ParameterError("kv_cache_dtype", "kv_cache_dtype='adaptive' does not combine with kv_eviction")

    def _check_policy(self) -> None:
        # Imported here: the scheduler pulls in the KV block manager, which the config has no other need for.
        from minipd.engine.scheduler import POLICIES, SchedulingPolicy

        policy = self.scheduling_policy
        if isinstance(policy, SchedulingPolicy) or (isinstance(policy, str) and policy in POLICIES):
            return
        hint = " (pass an instance, not the class)" if isinstance(policy, type) else ""
        raise ParameterError("scheduling_policy",
                             f"scheduling_policy must be one of {', '.join(repr(p) for p in POLICIES)} "
                             f"or a SchedulingPolicy instance{hint}, got {policy!r}")

    def _check_backend(self) -> None:
        from minipd.kernels.backend import BACKENDS

        # Whether the backend can run on the chosen device is checked later, once the device is known.
        if self.cpu_threads != "auto" and (not is_integer(self.cpu_threads) or self.cpu_threads < 1):
            raise ParameterError("cpu_threads",
                                 f"cpu_threads must be 'auto' or a positive integer, got {self.cpu_threads!r}")
        if self.weight_dtype not in ("auto", "int8"):
            raise ParameterError("weight_dtype", f"weight_dtype must be 'auto' or 'int8', got {self.weight_dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ParameterError("linear_backend",
                                 f"linear_backend must be one of {', '.join(repr(b) for b in LINEAR_BACKENDS)}, "
                                 f"got {self.linear_backend!r}")
        if self.kernel_backend is not None and self.kernel_backend not in BACKENDS:
            raise ParameterError("kernel_backend",
                                 f"kernel_backend must be None or one of {', '.join(repr(b) for b in BACKENDS)}, "
                                 f"got {self.kernel_backend!r}")

    @classmethod
    def from_options(cls, options: dict) -> EngineConfig:
        """Build from ``LLM(**options)``: flat fields, or groups of them (see :meth:`flatten`); an unknown
        option is an error that lists the known ones."""
        options = cls.flatten(options)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ParameterError(unknown[0], f"unknown engine option(s) {', '.join(unknown)}; "
                                             f"known: {', '.join(sorted(known))} (or the groups "
                                             f"{', '.join(GROUPS)})")
        return cls(**options)

    @staticmethod
    def flatten(options: dict) -> dict:
        """``options`` with every group (``cache={"block_size": 32}``) spread into its fields; a field given
        both flat and in its group, or in a group it does not belong to, is refused. Other keys pass as given."""
        flat = {k: v for k, v in options.items() if k not in GROUPS}
        for group, values in options.items():
            if group not in GROUPS:
                continue
            if not isinstance(values, dict):
                raise ParameterError(group, f"{group} must be a dict of its fields ({', '.join(GROUPS[group])}), "
                                            f"got {type(values).__name__}")
            for name, value in values.items():
                if name not in GROUPS[group]:
                    raise ParameterError(f"{group}.{name}", f"{group} has no field {name!r}; its fields: "
                                                            f"{', '.join(GROUPS[group])}")
                if name in flat:
                    raise ParameterError(name, f"{name} is given twice: flat and in {group}")
                flat[name] = value
        return flat

    def grouped(self) -> dict[str, dict[str, object]]:
        """The fields by group (scheduler, cache, kernels, compile, moe, snapshots)."""
        return {group: {name: getattr(self, name) for name in names} for group, names in GROUPS.items()}

    @property
    def scheduler(self) -> SimpleNamespace:
        """The scheduler's fields: token budget, sequences, policy, stats kept."""
        return SimpleNamespace(**self.grouped()["scheduler"])

    @property
    def cache(self) -> SimpleNamespace:
        """The KV cache's fields: blocks, memory, prefix caching, format, adaptive precision, eviction."""
        return SimpleNamespace(**self.grouped()["cache"])

    @property
    def kernels(self) -> SimpleNamespace:
        """The kernels' fields: attention backend, linears, weight dtype, CPU threads."""
        return SimpleNamespace(**self.grouped()["kernels"])

    @property
    def compile(self) -> SimpleNamespace:
        """Compiled decode's fields."""
        return SimpleNamespace(**self.grouped()["compile"])

    @property
    def moe(self) -> SimpleNamespace:
        """Mixture of experts' fields: expert backend, capacity, routing and dispatch formats, expert parallelism."""
        return SimpleNamespace(**self.grouped()["moe"])


#: EngineConfig's fields by group: ``LLM(model, cache={"block_size": 32, "kv_cache_dtype": "int8"})`` is
#: ``LLM(model, block_size=32, kv_cache_dtype="int8")``, and ``config.cache.block_size`` reads one back.
GROUPS: dict[str, tuple[str, ...]] = {
    "scheduler": ("max_num_batched_tokens", "max_num_seqs", "scheduling_policy", "stats_history"),
    "cache": ("block_size", "num_kv_blocks", "kv_cache_memory", "enable_prefix_caching", "kv_cache_dtype",
              "kv_adaptive_format", "kv_adaptive_thresholds", "kv_eviction", "kv_budget", "kv_eviction_granularity"),
    "kernels": ("kernel_backend", "linear_backend", "weight_dtype", "cpu_threads"),
    "compile": ("compile_decode", "compile_warmup", "compile_batch_sizes", "long_lived"),
    "moe": ("moe_backend", "moe_capacity_factor", "moe_overflow", "router_dtype", "moe_dispatch_dtype",
            "expert_parallel_size", "expert_parallel_timeout", "expert_parallel_overlap", "record_routing"),
    "snapshots": ("snapshot_interval", "snapshot_path"),
}
