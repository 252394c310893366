"""A decode step of fixed shape, compiled once per (batch, block-table width) bucket (``compile_decode=True``).

An eager decode step of a small model is mostly Python: a few dozen small ops per layer, each
dispatched from the interpreter, plus attention code that looks at lengths on the host. A step of
*fixed* shape can instead be traced once and run as one compiled program (``torch.compile``; on a
GPU, ``mode="reduce-overhead"`` also captures it as a CUDA graph, replayed with one launch). Fixed
shape means:

- the batch is padded to a bucket size (1, 2, 4, 8, 12, then multiples of 8), the padding rows attending only
  to their own token; block tables are padded with block 0 to a bucket width (powers of two of blocks
  for the torch attention, which gathers the whole width; the widest table for the C++ kernel, which
  reads each sequence only up to its length);
- nothing reads a length on the host: attention takes the lengths as a tensor;
- the graph does not write the KV pool. Writing into a slice of one big pool tensor inside a compiled
  graph makes the functionalised program copy the whole pool on every call, so the graph *returns*
  each layer's new K and V, attention reads the new token's K/V from those instead of the pool
  (:func:`~minipd.kernels.paged_attention.decode_attention_with_new`), and one ``index_copy_`` after
  the graph stores all layers.

Each bucket is compiled on its first use (a few seconds to tens of seconds on a laptop CPU), all at
start-up with ``compile_warmup=True``, or -- what ``compile_decode="auto"`` does for a long-lived engine --
in the background (:meth:`CompiledDecode.compile_in_background`): smallest bucket first, while steps whose
bucket is not ready yet run eagerly, so no step ever waits for the compiler. The weights are inputs of
the program, read where they lie (not frozen into it as constants: that saved nothing a step here, and
a frozen program cannot be reloaded whole from the compiler's on-disk cache, so a second start of the same
engine took 4.2 s to ready its first program instead of 2.9). On a CPU each program is also kept whole on disk
(:mod:`minipd.engine.program_cache`: torch's AOT precompile, keyed by everything the trace depends on), so a
later process loads it with nothing traced: a warm start of tiny-py's 11 programs readies the first 2.6–3.8 s
after compiling began and all after 3.4–4.7 s, against 4.7–5.2 s and 17.7–19.2 s traced again (2-core EPYC).
Steps the compiled program does not cover
run eagerly: anything with a prefill chunk, a batch or context beyond the largest bucket, a layer hook
(layer-wise KV transfer), prompt log-probabilities.

Beyond a plain pool: a pool of per-token codes (int8, fp8, int4_per_token) has each new row quantized in
the program, which attends to it as read back from its codes (as an eager step attends to the row it has
just stored) and returns codes and scales for the pool; MLA's latent rows are kept and attended like K; for
eviction by received attention the program also returns each layer's queries (:meth:`CompiledDecode.observe`).
Under adaptive KV precision (:class:`AdaptiveRows`) each row is attended over the pages as floats and over them
as compressed blocks, and keeps its own format's result; its new row is stored as floats or as codes. Over
KIVI's ``int4`` cache (:class:`KiviRows`) the new rows are stored after the program as the step's residual plan
says, and a row whose token fills its block attends to that block sealed into codes, as an eager step does.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from minipd.engine import program_cache
from minipd.engine.compiler_keys import prime_compiler_keys
from minipd.kernels.backend import TORCH_BACKEND
from minipd.kernels.mla import LatentUpProjection, paged_mla_decode_with_new
from minipd.kernels.paged_attention import decode_attention_with_new
from minipd.kv.paged_pool import PagedKVPool
from minipd.kv.quant import FORMATS, QuantFormat, QuantizedLayerCache
from minipd.models.decoder import DecoderModel
from minipd.models.forward_context import ForwardContext

logger = logging.getLogger("minipd")

#: How often the interpreter offers the GIL to another thread while a program compiles in the background
#: (seconds; Python's default is 0.005). Tracing holds the GIL for long stretches: at the default, a step
#: running beside it waited for the GIL at every op (a 90-token batch took 13 s instead of 3 here).
COMPILE_SWITCH_INTERVAL = 0.0005
#: A background compilation starts a program while the engine is idle, or once it has waited this long
#: (seconds) for an idle moment: tracing a program holds the GIL for seconds, which steps would feel.
COMPILE_WAIT_FOR_IDLE_S = 30.0
_switch_lock = threading.Lock()
_compiling_now = 0
_caller_interval = 0.005


def _background_started() -> None:
    global _compiling_now, _caller_interval
    with _switch_lock:
        if _compiling_now == 0:
            _caller_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_caller_interval, COMPILE_SWITCH_INTERVAL))
        _compiling_now += 1


def _background_ended() -> None:
    global _compiling_now
    with _switch_lock:
        _compiling_now -= 1
        if _compiling_now == 0:
            sys.setswitchinterval(_caller_interval)


def compiling_in_background() -> bool:
    """Whether any engine of this process is still compiling decode programs in the background."""
    return _compiling_now > 0


def cpu_decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, window: int) -> torch.Tensor:
    """:func:`decode_attention_with_new` through the C++ kernel, which reads each sequence's blocks up to its
    length only (so the table's width costs nothing). It is a dispatcher op (``torch.ops.minipd_cpu``): the
    compiled graph calls it whole; the conversions here are traced into the graph. The new rows are rounded to
    the pool's dtype first (an fp16 pool of an fp32 model), as storing them would, so the step attends to what an
    eager step reads back."""
    return torch.ops.minipd_cpu.paged_decode(q.contiguous(), k_cache, v_cache, block_tables.to(torch.int64),
                                             context_lens.to(torch.int64), scale, window,
                                             k_new.to(k_cache.dtype).contiguous(), v_new.to(v_cache.dtype).contiguous())


class AdaptiveRows:
    """A traced step's rows under adaptive KV precision: which are compressed, and each format's tables and lengths
    (a row of the other format gets a table of block 0 and length 1: it attends to its new token only)."""

    def __init__(self, compressed: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 k_codes: torch.Tensor, v_codes: torch.Tensor) -> None:
        self.mask = compressed != 0
        self.k_codes, self.v_codes = k_codes, v_codes
        column = self.mask[:, None]
        self.full_tables = torch.where(column, torch.zeros_like(block_tables), block_tables)
        self.parts_tables = torch.where(column, block_tables, torch.zeros_like(block_tables))
        ones = torch.ones_like(context_lens)
        self.full_lens = torch.where(self.mask, ones, context_lens)
        self.parts_lens = torch.where(self.mask, context_lens, ones)


class KiviRows:
    """A traced step's rows over KIVI's ``int4`` cache (:mod:`minipd.kv.residual`).

    Each row's new token goes to row ``window_rows`` of the residual window (its filling block's slot times the
    block size, plus its offset); a row whose token completes its block (``context_lens % block_size == 0``) has
    that block sealed into per-channel codes by an eager step *before* it attends, so it reads the whole block,
    its new token included, back from those codes: the program seals it too (:meth:`sealed_keys`). V is coded
    per token, so a sealed block's earlier V rows are the codes the pool already holds.
    """

    def __init__(self, window_rows: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 residual_k: torch.Tensor, residual_v: torch.Tensor) -> None:
        self.slots = (window_rows // block_size).clamp(min=0).long()
        self.fills = context_lens % block_size == 0
        self.last_block = ((context_lens - 1) // block_size).long()
        self.residual_k, self.residual_v = residual_k, residual_v

    def sealed_keys(self, layer_idx: int, k: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
        """Each row's filling block of K with the new row last, sealed into per-channel codes and read back
        ``(B, block_size, kv_heads, head_dim)`` (what a row that fills its block attends to)."""
        window = self.residual_k[layer_idx]
        rows = torch.cat((window[self.slots][:, :-1], k[:, None].to(window.dtype)), dim=1).float()
        codes, scales = fmt.quantize_channels(rows)
        return fmt.dequantize_channels(codes, scales, dtype)


class TracedWindowCache(QuantizedLayerCache):
    """One layer's K or V of a KIVI cache as a traced step reads it: :class:`~minipd.kv.residual.WindowedLayerCache`
    without its host-side shortcut, and with the blocks rows seal this step (``sealed``, at each row's
    ``last_block`` where ``fills``) in place of their codes."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor, fmt: QuantFormat,
                 dtype: torch.dtype, per_channel: bool, sealed: torch.Tensor | None = None,
                 rows: KiviRows | None = None) -> None:
        super().__init__(codes, scales, fmt, dtype)
        self.residual, self.per_channel, self.sealed, self.rows = residual, per_channel, sealed, rows
        self.num_blocks = codes.shape[0]

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.per_channel:
            return self.fmt.dequantize_channels(codes, scales, self.dtype)
        return super().decode_blocks(codes, scales)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` (B, W) as values: codes decoded, residual rows for ids past the pool, sealed blocks."""
        values = super().__getitem__(index.clamp(max=self.num_blocks - 1))
        window = self.residual[(index - self.num_blocks).clamp(min=0)].to(self.dtype)
        values = torch.where((index >= self.num_blocks)[..., None, None, None], window, values)
        if self.sealed is None or self.rows is None:
            return values
        columns = torch.arange(index.shape[1], device=index.device)[None, :]
        at = (columns == self.rows.last_block[:, None]) & self.rows.fills[:, None]
        return torch.where(at[..., None, None, None], self.sealed[:, None], values)


class StaticDecodeCache:
    """The model's cache interface for one traced decode step: attends, and keeps each layer's new K/V.

    Over a quantized pool (a per-token format: ``scales`` given) the new K/V are quantized here, in the
    program: it keeps their codes and scales for the pool, and attention reads the new token back from its
    codes, as an eager step reads the row it has just stored."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, attend: Callable[..., torch.Tensor],
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None, fmt: QuantFormat | None = None,
                 keep_queries: bool = False, compressed: AdaptiveRows | None = None,
                 kivi: KiviRows | None = None) -> None:
        self.k_pool, self.v_pool = k_pool, v_pool
        self.block_tables, self.context_lens = block_tables, context_lens
        self._attend = attend
        self.scales, self.fmt = scales, fmt
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []
        self.new_k_scales: list[torch.Tensor] = []
        self.new_v_scales: list[torch.Tensor] = []
        #: Adaptive KV precision: the compressed rows' view of the pool; their new rows' codes are kept here.
        self.compressed = compressed
        #: KIVI's int4 cache: where each row's new token goes in the residual window.
        self.kivi = kivi
        self.new_k_codes: list[torch.Tensor] = []
        self.new_v_codes: list[torch.Tensor] = []
        #: Each layer's queries, kept when an attention observer (eviction by received attention) reads them.
        self.queries: list[torch.Tensor] | None = [] if keep_queries else None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        k_cache, v_cache = self.k_pool[layer_idx], self.v_pool[layer_idx]
        if self.queries is not None:
            self.queries.append(q)
        window = -1 if sliding_window is None else sliding_window
        if self.compressed is not None:
            return self._attend_adaptive(layer_idx, q, k, v, k_cache, v_cache, scale, window)
        if self.kivi is not None:
            return self._attend_kivi(layer_idx, q, k, v, k_cache, v_cache, scale, window)
        if self.fmt is not None and self.scales is not None:
            (k_codes, k_scales), (v_codes, v_scales) = self.fmt.quantize(k), self.fmt.quantize(v)
            self.new_k_scales.append(k_scales)
            self.new_v_scales.append(v_scales)
            self.new_k.append(k_codes)
            self.new_v.append(v_codes)
            k, v = self.fmt.dequantize(k_codes, k_scales, q.dtype), self.fmt.dequantize(v_codes, v_scales, q.dtype)
            k_cache = QuantizedLayerCache(k_cache, self.scales[0][layer_idx], self.fmt, q.dtype)
            v_cache = QuantizedLayerCache(v_cache, self.scales[1][layer_idx], self.fmt, q.dtype)
        else:
            self.new_k.append(k)
            self.new_v.append(v)
        return self._attend(q, k, v, k_cache, v_cache, self.block_tables, self.context_lens, scale, window)

    def _attend_adaptive(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int) -> torch.Tensor:
        """Every row twice, once over the pages as floats and once over them as compressed blocks, each row's own
        format chosen after: in the other format's pass a row has a table of block 0 and only its new token to
        attend to (a row of a format costs nothing in the other's pass). A compressed row's new K/V are quantized
        here and read back from their codes, as an eager step reads the rows it has just stored."""
        rows, fmt = self.compressed, self.fmt
        assert rows is not None and fmt is not None and self.scales is not None
        (k_codes, k_scales), (v_codes, v_scales) = fmt.quantize(k), fmt.quantize(v)
        self.new_k.append(k)
        self.new_v.append(v)
        self.new_k_codes.append(k_codes)
        self.new_v_codes.append(v_codes)
        self.new_k_scales.append(k_scales)
        self.new_v_scales.append(v_scales)
        full = self._attend(q, k, v, k_cache, v_cache, rows.full_tables, rows.full_lens, scale, window)
        k_parts = QuantizedLayerCache(rows.k_codes[layer_idx], self.scales[0][layer_idx], fmt, q.dtype)
        v_parts = QuantizedLayerCache(rows.v_codes[layer_idx], self.scales[1][layer_idx], fmt, q.dtype)
        compressed = self._attend(q, fmt.dequantize(k_codes, k_scales, q.dtype), fmt.dequantize(v_codes, v_scales,
                                                                                                q.dtype),
                                  k_parts, v_parts, rows.parts_tables, rows.parts_lens, scale, window)
        return torch.where(rows.mask[:, None, None], compressed, full)

    def _attend_kivi(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_codes: torch.Tensor,
                     v_codes: torch.Tensor, scale: float, window: int) -> torch.Tensor:
        """Over KIVI's cache as an eager step reads it once it has stored the new rows: a new row as the window holds
        it, or, where it completes its block, that block as sealed codes (K per channel, V per token)."""
        rows, fmt = self.kivi, self.fmt
        assert rows is not None and fmt is not None and self.scales is not None
        self.new_k.append(k)
        self.new_v.append(v)
        sealed = rows.sealed_keys(layer_idx, k, fmt, q.dtype)
        k_cache = TracedWindowCache(k_codes, self.scales[0][layer_idx], rows.residual_k[layer_idx], fmt, q.dtype, True,
                                    sealed, rows)
        v_cache = TracedWindowCache(v_codes, self.scales[1][layer_idx], rows.residual_v[layer_idx], fmt, q.dtype,
                                    False)
        fills = rows.fills[:, None, None]
        k_new = torch.where(fills, sealed[:, -1], k.to(rows.residual_k.dtype).to(q.dtype))
        v_read = fmt.dequantize(*fmt.quantize(v), q.dtype)
        v_new = torch.where(fills, v_read, v.to(rows.residual_v.dtype).to(q.dtype))
        return self._attend(q, k_new, v_new, k_cache, v_cache, self.block_tables, self.context_lens, scale, window)

    def attend_latent(self, layer_idx: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
                      up: LatentUpProjection) -> torch.Tensor:
        """Multi-head latent attention: keeps each sequence's new latent row (the pool's one "head" of K; V is
        zero-width) and attends to it and the cached ones."""
        self.new_k.append(rows[:, None])
        self.new_v.append(rows.new_zeros(rows.shape[0], 1, 0))
        return paged_mla_decode_with_new(q, rows, self.k_pool[layer_idx], self.block_tables,
                                         self.context_lens, scale, up)

    def advance(self, num_tokens: int) -> None:
        """Nothing to do (the scheduler tracks what is computed)."""


def bucket_sizes(largest: int, step: int = 8) -> list[int]:
    """1, 2, 4, ``step``, 1.5 ``step``, then every multiple of ``step`` below ``largest``, and ``largest`` itself.

    Fine steps matter: a batch runs padded to its bucket, so with powers of two a batch of 33 would
    compute 64 rows (vLLM's CUDA-graph capture sizes are spaced the same way). The one bucket between
    ``step`` and twice it is for the CPU, where a decode step's cost grows with its rows from about 8 on:
    on a Zen 5 EPYC the 50M-parameter model's steps of 9-12 rows took 6.6 ms padded to 16, 5.1 ms to 12.
    """
    sizes = [n for n in (1, 2, 4, step, step + step // 2) if n < largest] + list(range(2 * step, largest, step))
    return sorted({*sizes, largest})


def _powers_of_two(largest: int) -> list[int]:
    """1, 2, 4, ... below ``largest``, and ``largest`` (block-table widths: attention grows with the width)."""
    sizes = [1]
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, largest})


def _bucket(sizes: Sequence[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


class CompiledDecode:
    """Runs pure-decode steps through one compiled program per (batch bucket, width bucket).

    Args:
        model: the engine's model (its modules are traced as they are: packed or int8 linears included).
        pool: the engine's paged pool (plain, in the model's dtype).
        attend: decode attention with the new token supplied (:func:`decode_attention_with_new`, or
            :func:`cpu_decode_attention`, whose kernel is a dispatcher op the compiler calls whole).
        batch_sizes: batch buckets; ``max_blocks``: the widest block table (the model's length in blocks).
        width_buckets: pad block tables to powers of two of blocks (True), for an attention whose cost grows
            with the padded width (the torch reference gathers it all), or always to ``max_blocks`` (False),
            for a kernel that reads each sequence's blocks only up to its length: one graph per batch size.
        keep_queries: programs also return each layer's queries, which :meth:`observe` shows to an attention
            observer after the step (eviction by received attention: H2O, SnapKV).
        cpp_wrapper: on a CPU, generate the code around the program's kernels as C++ instead of Python (inductor's
            ``cpp_wrapper``): less time a step, more time compiling (what a long-lived engine chooses).
    """

    #: Buckets of every instance so far (see the recompile limit in ``__init__``).
    _graphs = 0

    def __init__(self, model: DecoderModel, pool: PagedKVPool, attend: Callable[..., torch.Tensor],
                 batch_sizes: Sequence[int], max_blocks: int, width_buckets: bool = True,
                 keep_queries: bool = False, cpp_wrapper: bool = False) -> None:
        spec = pool.spec
        self.model = model
        self.pool = pool
        self.attend = attend
        #: Adaptive KV precision: the pages are read as floats or as compressed blocks, row by row.
        self.adaptive = hasattr(pool, "compressed_layer")
        #: KIVI's int4 cache: a step's new rows go to its residual window, and blocks they fill are sealed.
        self.kivi = spec.has_residual_window
        #: The code format of a quantized pool, or of an adaptive pool's compressed blocks (their rows are
        #: quantized in the program); None for a plain pool.
        self.fmt = pool.fmt if self.adaptive else FORMATS[spec.quant] if spec.quant else None  # type: ignore[attr-defined]
        #: Programs also return each layer's queries, for :meth:`observe` (eviction by received attention).
        self.keep_queries = keep_queries
        self.last_queries: torch.Tensor | None = None
        #: Each layer's attention scale, as its attention module passes it (what :meth:`observe` hands on).
        self.attention_scales = {m.layer_idx: float(m.scale) for m in model.modules()
                                 if hasattr(m, "layer_idx") and hasattr(m, "scale")}
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = _powers_of_two(max_blocks) if width_buckets else [max_blocks]
        self.device = model.embed_tokens.weight.device
        #: The torch references: the compiler fuses them into the step (no custom kernel to call).
        self.kernels = TORCH_BACKEND
        cuda = self.device.type == "cuda"
        if cuda:
            # The pool is read by the captured graphs in place: it must not be copied into graph-owned inputs.
            torch._dynamo.mark_static_address(pool.k)
            torch._dynamo.mark_static_address(pool.v)
        # Every bucket is its own graph, and every engine in the process adds its own to the same traced
        # function: past dynamo's limit (8) it would quietly run eagerly, so the limit grows with them --
        # only while this class traces (a scoped patch, see run()), not for the rest of the process.
        # (Doubled, with room: a program is also traced again when torch's thread count changes.)
        CompiledDecode._graphs += len(self.batch_sizes) * len(self.widths)
        #: (bucket, thread count) pairs traced: a new one may trace again, under the raised limits.
        self._traced: set[tuple[tuple[int, int], int]] = set()
        # On a CPU: no per-call checks of every input's layout, which cost ~0.1 ms a step at batch 1 (the
        # inputs are built by run() and cannot vary). Not frozen: see the module's docstring. Casts to fp16/bf16
        # round as eager ones do: inductor would keep them in fp32 inside a fused loop, and a quantized pool's
        # codes would then be computed with a scale other than the fp16 one stored beside them.
        cpu_options = {"freezing": False, "size_asserts": False, "alignment_asserts": False,
                       "emulate_precision_casts": True}
        #: Whether the programs' wrapper is C++ (see ``cpp_wrapper``).
        self.cpp_wrapper = cpp_wrapper and not cuda
        if self.cpp_wrapper:
            # The code that calls each fused loop and op in turn generated as C++, not Python: ~0.1 ms less a
            # step at batch 1 (0.71 -> 0.61 ms for tiny-py on a 2-core EPYC), for ~10 s more compiling a program.
            cpu_options["cpp_wrapper"] = True
        self._step = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                   **({"mode": "reduce-overhead"} if cuda else {"options": cpu_options}))
        self._cpu_options = cpu_options
        #: On a CPU, each program is precompiled whole (torch's AOT precompile) and kept on disk, so that a
        #: later process loads it with nothing traced (:mod:`minipd.engine.program_cache`; the key stands in
        #: for the guards, which these programs skip). CUDA graphs stay on the traced path.
        self._precompile = not cuda and program_cache.enabled()
        self._aot_step = torch.compile(self._forward, fullgraph=True, dynamic=False, options={
            **cpu_options, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}) if self._precompile else None
        #: The precompiled programs, by (bucket, thread count).
        self._programs: dict[tuple[tuple[int, int], int], Callable[..., tuple[torch.Tensor | None, ...]]] = {}
        #: Buckets whose program was loaded from disk (the others were traced in this process).
        self.loaded: set[tuple[int, int]] = set()
        #: Each precompiled bucket's file on disk (loaded from it, or kept in it).
        self.program_files: dict[tuple[int, int], Path] = {}
        self._model_description: dict | None = None
        #: (batch bucket, width bucket) pairs compiled so far.
        self.compiled: set[tuple[int, int]] = set()
        #: While compiling in the background: the buckets steps may use (the ones compiled); None otherwise.
        self.ready: set[tuple[int, int]] | None = None
        self._background: threading.Thread | None = None
        self._stop = threading.Event()
        #: Seconds from the start of background compilation until each program was ready, in order.
        self.ready_after: list[float] = []
        #: When the background compilation started (``time.perf_counter()``), None before.
        self.compile_started: float | None = None
        #: Set while the engine has no request to run (the engine sets and clears it): when a background
        #: compilation prefers to trace.
        self.idle = threading.Event()
        self.idle.set()
        self._static: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        num_layers, num_blocks, block_size = pool.k.shape[:3]
        self._flat_k = pool.k.view(num_layers, num_blocks * block_size, *pool.k.shape[3:])
        self._flat_v = pool.v.view(num_layers, num_blocks * block_size, *pool.v.shape[3:])
        #: What the programs read besides the step's inputs: the pool's K and V, the scales of its codes (or
        #: of an adaptive pool's compressed blocks), and an adaptive pool's pages seen as compressed blocks or
        #: KIVI's residual window.
        self._pool_inputs: tuple[torch.Tensor | None, ...] = (pool.k, pool.v, pool.k_scale, pool.v_scale, None, None)
        #: The per-token scales of a quantized pool, one row per token slot (None for a plain pool).
        self._flat_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        #: An adaptive pool's compressed blocks, codes and scales, one row per token slot.
        self._flat_codes: tuple[torch.Tensor, ...] | None = None
        if self.adaptive:
            # The pages seen as compressed blocks (block id = page * ratio + part), every layer at once.
            layer_codes = pool.compressed_layer(0, torch.float32)[0].codes  # type: ignore[attr-defined]
            shape = (num_layers, *layer_codes.shape)
            k_codes, v_codes = pool.k.view(layer_codes.dtype).view(shape), pool.v.view(layer_codes.dtype).view(shape)
            k_scales, v_scales = pool.part_k_scale, pool.part_v_scale  # type: ignore[attr-defined]
            self._pool_inputs = (pool.k, pool.v, k_scales, v_scales, k_codes, v_codes)
            slots = shape[1] * shape[2]
            self._flat_codes = tuple(t.view(num_layers, slots, *shape[3:]) for t in (k_codes, v_codes)) + tuple(
                t.view(num_layers, slots, -1) for t in (k_scales, v_scales))
        elif self.kivi:
            self._pool_inputs = (pool.k, pool.v, pool.k_scale, pool.v_scale, pool.residual_k, pool.residual_v)
        elif self.fmt is not None and pool.k_scale is not None and pool.v_scale is not None:
            self._flat_scales = (pool.k_scale.view(num_layers, num_blocks * block_size, -1),
                                 pool.v_scale.view(num_layers, num_blocks * block_size, -1))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, row_extra: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, k_other: torch.Tensor | None,
                 v_other: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """One step. ``row_extra`` and ``k_other``/``v_other`` serve two caches: under adaptive precision, which rows
        are compressed and the pages seen as compressed blocks; for KIVI, each new token's row in the residual window
        and the window itself (unused otherwise)."""
        scales = None if k_scale is None or v_scale is None else (k_scale, v_scale)
        adaptive = kivi = None
        if k_other is not None and v_other is not None:
            if self.kivi:
                kivi = KiviRows(row_extra, context_lens, self.pool.block_size, k_other, v_other)
            else:
                adaptive = AdaptiveRows(row_extra, block_tables, context_lens, k_other, v_other)
        cache = StaticDecodeCache(k_pool, v_pool, block_tables, context_lens, self.attend, scales, self.fmt,
                                  self.keep_queries, adaptive, kivi)
        # The kernels are reached through ``self`` (an input of the traced call): the compiler can only wrap
        # objects it can find again. (On torch 2.11 it also failed on ForwardContext's default value: see there.)
        hidden = self.model(input_ids, positions, ForwardContext(cache, self.kernels))  # type: ignore[arg-type]
        logits = self.model.compute_logits(hidden)
        # (Scales only for a quantized pool, queries only when kept: None otherwise.)
        return (logits, *(torch.stack(parts) if parts else None for parts in (
            cache.new_k, cache.new_v, cache.new_k_scales, cache.new_v_scales, cache.queries, cache.new_k_codes,
            cache.new_v_codes)))

    def buckets_for(self, batch: int, width: int) -> tuple[int, int] | None:
        """The (batch, width) bucket a step of ``batch`` sequences and ``width`` blocks runs in; None if too big,
        or, while compiling in the background, not compiled yet."""
        b, w = _bucket(self.batch_sizes, batch), _bucket(self.widths, width)
        if b is None or w is None:
            return None
        ready = self.ready
        return (b, w) if ready is None or (b, w) in ready else None

    @property
    def num_buckets(self) -> int:
        """How many (batch, width) programs cover every step this program takes."""
        return len(self.batch_sizes) * len(self.widths)

    @property
    def compiling(self) -> bool:
        """Whether buckets are still being compiled in the background."""
        return self._background is not None and self._background.is_alive()

    def compile_in_background(self, threads: int | None = None) -> None:
        """Compile every bucket in a background thread, smallest first, each when the engine is idle (or after
        :data:`COMPILE_WAIT_FOR_IDLE_S` of waiting for that); until a bucket is ready, the steps it would run
        go eagerly (:meth:`buckets_for` says None). ``threads``: the CPU thread count the compiled steps run on
        (a program is built for one); the compiling thread sets it for itself (OpenMP's count is per thread).

        The dummy steps only *read* the pool (a program returns its new K/V; :meth:`run` stores them), so
        compiling beside live requests leaves their K/V alone."""
        if self._background is not None:
            return
        self.ready = set()
        pairs = sorted((b, w) for b in self.batch_sizes for w in self.widths)
        self._background = threading.Thread(target=self._compile_all, args=(pairs, threads),
                                            name="minipd-compile-decode", daemon=True)
        _background_started()
        self._background.start()

    def _compile_all(self, pairs: list[tuple[int, int]], threads: int | None) -> None:
        import torch._inductor.config as inductor_config

        start = self.compile_started = time.perf_counter()
        try:
            # Grad mode is per thread (the steps run in inference mode); one compile thread: no pool of compile
            # processes beside a server (they would outlive nothing, but show up as its children).
            with torch.inference_mode(), inductor_config.patch(compile_threads=1):
                for rows, cols in pairs:
                    waited = 0.0
                    while not self.idle.wait(0.1) and waited < COMPILE_WAIT_FOR_IDLE_S and not self._stop.is_set():
                        waited += 0.1
                    if self._stop.is_set():
                        return
                    if threads is not None and torch.get_num_threads() != threads:
                        torch.set_num_threads(threads)
                    self._trace((rows, cols))
                    self.ready.add((rows, cols))  # type: ignore[union-attr]
                    self.ready_after.append(time.perf_counter() - start)
        except Exception as err:  # a compiler failure leaves the engine eager, not broken
            logger.warning("compile_decode: background compilation stopped (%s: %s); steps it did not cover run "
                           "eagerly", type(err).__name__, err)
        finally:
            _background_ended()

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compilation is over (every bucket ready, or it stopped); returns whether
        it is over."""
        if self._background is not None:
            self._background.join(timeout)
        return not self.compiling

    def stop_compiling(self, timeout: float | None = None) -> None:
        """Compile no further bucket (the one being compiled finishes first: up to ``timeout`` seconds)."""
        self._stop.set()
        if self._background is not None:
            self._background.join(timeout)

    def _trace(self, bucket: tuple[int, int]) -> None:
        """Build ``bucket``'s program by calling it once on dummy inputs of its own (not the bucket's, which a
        step may be filling meanwhile); nothing is stored."""
        self._call(bucket, *self._new_inputs(bucket))
        self.compiled.add(bucket)

    def _call(self, bucket: tuple[int, int], ids: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, row_extra: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        key = (bucket, torch.get_num_threads())
        program = self._programs.get(key)
        if program is not None:
            return program(self, ids, pos, tables, lens, row_extra, *self._pool_inputs)
        if key in self._traced:
            return self._step(ids, pos, tables, lens, row_extra, *self._pool_inputs)
        # May trace: inductor's source hashes from the on-disk store first (a warm start then loads its programs
        # without rehashing torch), and dynamo's limits raised for this call only (a patch costs ~30 us a step).
        prime_compiler_keys()
        if self._precompile:
            program = self._precompiled(bucket, (ids, pos, tables, lens, row_extra))
            if program is not None:
                self._programs[key] = program
                return program(self, ids, pos, tables, lens, row_extra, *self._pool_inputs)
        limit = 2 * CompiledDecode._graphs + 8
        with torch._dynamo.config.patch(recompile_limit=max(limit, torch._dynamo.config.recompile_limit),
                                        accumulated_recompile_limit=max(
                                            limit, torch._dynamo.config.accumulated_recompile_limit)):
            out = self._step(ids, pos, tables, lens, row_extra, *self._pool_inputs)
        self._traced.add(key)
        return out

    def _precompiled(self, bucket: tuple[int, int], inputs: tuple[torch.Tensor, ...]
                     ) -> Callable[..., tuple[torch.Tensor | None, ...]] | None:
        """``bucket``'s program loaded from disk (if one was kept for this very step and agrees with the eager
        step on a probe), else precompiled now and kept; None if torch cannot precompile it (then it is traced)."""
        args = (*inputs, *self._pool_inputs)
        key = self._program_key(bucket, args)
        external = {"decode": self, "model": self.model}  # live objects: referred to by the file, not written
        program = program_cache.load(key, external)
        if program is not None:
            if self._agrees_with_eager(program, bucket):
                self.loaded.add(bucket)
                self.program_files[bucket] = program_cache.path_for(key)
                return program
            logger.warning("compile_decode: the program kept for bucket %s differs from the eager step; tracing it "
                           "again", bucket)
        try:
            with program_cache.stable_graph_name(key):
                program = self._aot_step.aot_compile((args, {}))  # type: ignore[union-attr]
        except Exception as err:  # an op or input the precompiler does not take: the traced path
            logger.info("compile_decode: bucket %s not precompiled (%s: %s); traced instead", bucket,
                        type(err).__name__, err)
            return None
        program.disable_guard_check()  # its guards were left out on purpose: the key covers them
        saved = program_cache.save(program, key, external)
        if saved is not None:
            self.program_files[bucket] = saved
        return program

    def _program_key(self, bucket: tuple[int, int], args: tuple[torch.Tensor | None, ...]) -> str:
        """The on-disk key of ``bucket``'s program: everything its trace depends on (see
        :mod:`minipd.engine.program_cache`)."""
        import torch._inductor.config as inductor_config

        if self._model_description is None:
            self._model_description = program_cache.describe_model(self.model)
        inductor = {k: v for k, v in inductor_config.save_config_portable().items()
                    if k not in ("compile_threads", "worker_start_method")}
        describe = program_cache.describe
        return program_cache.program_key({
            "program": "minipd decode step", "bucket": list(bucket), "model": self._model_description,
            "step": {"kivi": self.kivi, "adaptive": self.adaptive, "fmt": describe(self.fmt),
                     "keep_queries": self.keep_queries, "attend": describe(self.attend),
                     "kernels": describe(self.kernels), "pool": self._pool_description()},
            "inputs": [describe(a) for a in args], "options": describe(self._cpu_options),
            "inductor": describe(inductor), "default_dtype": str(torch.get_default_dtype())})

    def _pool_description(self) -> dict:
        """What of the pool shapes a program: its kind, layout and spec (not the state a step leaves in it, such
        as KIVI's step plan, which would make a bucket compiled while serving miss its program next time)."""
        pool = self.pool
        return {"type": type(pool).__qualname__, "block_size": pool.block_size, "num_blocks": pool.num_blocks,
                "residual_slots": getattr(pool, "num_residual_slots", 0),
                "spec": program_cache.describe(getattr(pool, "spec", None))}

    def _agrees_with_eager(self, program: Callable[..., tuple[torch.Tensor | None, ...]],
                           bucket: tuple[int, int]) -> bool:
        """Whether a loaded program gives the eager step's logits on a probe (random tokens and positions, each
        row attending to its own token), and the same outputs present: a last check that the key missed nothing
        that shapes the step."""
        ids, pos, tables, lens, extra = self._new_inputs(bucket)
        generator = torch.Generator().manual_seed(0)
        ids.copy_(torch.randint(0, self.model.embed_tokens.num_embeddings, ids.shape, generator=generator))
        pos.copy_(torch.randint(0, 8, pos.shape, generator=generator))  # (within any model's position table)
        args = (ids, pos, tables, lens, extra, *self._pool_inputs)
        try:
            got, want = program(self, *args), self._forward(*args)
        except Exception as err:
            logger.info("compile_decode: a loaded program failed its probe (%s: %s)", type(err).__name__, err)
            return False
        if [t is None for t in got] != [t is None for t in want] or got[0] is None or want[0] is None:
            return False
        tolerance = 1e-4 if want[0].dtype == torch.float32 else 2e-2
        scale = 1.0 + float(want[0].abs().max())
        return got[0].shape == want[0].shape and float((got[0] - want[0]).abs().max()) <= tolerance * scale

    def _new_inputs(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Fresh input tensors of a bucket's shape (ids, positions, tables, lengths, and a per-row extra: see
        :meth:`_forward`), made outside inference mode: the compiler guards on how an input was made."""
        rows, cols = bucket
        with torch.inference_mode(False):
            return (torch.zeros(rows, dtype=torch.int64, device=self.device),
                    torch.zeros(rows, dtype=torch.int64, device=self.device),
                    torch.zeros(rows, cols, dtype=torch.int32, device=self.device),
                    torch.ones(rows, dtype=torch.int32, device=self.device),
                    torch.zeros(rows, dtype=torch.int32, device=self.device))

    def _inputs(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """The bucket's input tensors, allocated once.

        Every call of a bucket's program sees the same tensors (what a CUDA graph needs anyway): a step's
        own tensors would differ from call to call (a slice of the runner's buffers, or a padded copy).
        """
        found = self._static.get(bucket)
        if found is None:
            found = self._new_inputs(bucket)
            if self.device.type == "cuda":  # replayed graphs read them in place, with no copy in
                for t in found:
                    torch._dynamo.mark_static_address(t)
            self._static[bucket] = found
        return found

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, slot_mapping: torch.Tensor, bucket: tuple[int, int],
            compressed_rows: int = 0) -> torch.Tensor:
        """Logits (batch, vocab) of one decode step, each sequence's new K/V stored in the pool.

        The inputs are copied into the bucket's tensors; padding rows get token 0 at position 0, a table of
        block 0 and length 1: they attend to their own (discarded) token only. Under adaptive KV precision the
        last ``compressed_rows`` rows are compressed requests' (their tables and slots name compressed blocks).
        """
        batch, width = block_tables.shape
        ids, pos, tables, lens, extra = self._inputs(bucket)
        for t in (ids, pos, tables, extra):
            t.zero_()
        lens.fill_(1)
        ids[:batch].copy_(input_ids)
        pos[:batch].copy_(positions)
        tables[:batch, :width].copy_(block_tables)
        lens[:batch].copy_(context_lens)
        full = batch - compressed_rows
        if compressed_rows:
            extra[full:batch].fill_(1)
        if self.kivi:  # each new token's row in the residual window (negative: written whole as codes)
            extra[:batch].copy_(slot_mapping - self.pool.num_blocks * self.pool.block_size)
        logits, new_k, new_v, new_k_scales, new_v_scales, queries, new_k_codes, new_v_codes = self._call(
            bucket, ids, pos, tables, lens, extra)
        self.compiled.add(bucket)
        slots = slot_mapping.to(torch.int64)
        if self.kivi:  # the step's writes as its plan says (the window's rows; blocks filled sealed), layer by layer
            assert new_k is not None and new_v is not None
            for layer in range(new_k.shape[0]):
                k_cache, v_cache = self.pool.layer(layer, new_k.dtype)
                k_cache.store(slots, new_k[layer, :batch])  # type: ignore[union-attr]
                v_cache.store(slots, new_v[layer, :batch])  # type: ignore[union-attr]
        elif self._flat_codes is not None:  # adaptive: floats for full-precision rows, codes for compressed ones
            self._flat_k.index_copy_(1, slots[:full], new_k[:, :full].to(self.pool.k.dtype))  # type: ignore[index]
            self._flat_v.index_copy_(1, slots[:full], new_v[:, :full].to(self.pool.v.dtype))  # type: ignore[index]
            parts = slots[full:batch]
            for flat, new in zip(self._flat_codes, (new_k_codes, new_v_codes, new_k_scales, new_v_scales),
                                 strict=True):
                flat.index_copy_(1, parts, new[:, full:batch].to(flat.dtype))  # type: ignore[index]
        else:
            self._flat_k.index_copy_(1, slots, new_k[:, :batch].to(self.pool.k.dtype))  # type: ignore[index]
            self._flat_v.index_copy_(1, slots, new_v[:, :batch].to(self.pool.v.dtype))  # type: ignore[index]
        if self._flat_scales is not None:
            self._flat_scales[0].index_copy_(1, slots, new_k_scales[:, :batch])  # type: ignore[index]
            self._flat_scales[1].index_copy_(1, slots, new_v_scales[:, :batch])  # type: ignore[index]
        self.last_queries = None if queries is None else queries[:, :batch]
        return logits[:batch]  # type: ignore[index]

    def observe(self, observer: Callable[[int, torch.Tensor, object, float], None]) -> None:
        """Show the last step's queries to ``observer(layer, q, k_cache, scale)``, layer by layer, as an eager step
        shows them before each layer attends (its new K/V are stored by now, as they are there)."""
        if self.last_queries is None:
            raise RuntimeError("this compiled step keeps no queries: build it with keep_queries=True")
        for layer, q in enumerate(self.last_queries):
            observer(layer, q, self.pool.layer(layer, q.dtype)[0], self.attention_scales[layer])

    @torch.inference_mode()
    def warm_up(self, progress: bool = True, threads: Callable[[int], int | None] | None = None) -> None:
        """Compile every bucket now: one dummy step each, every row of which writes slot 0 of block 0.
        Call it before any request holds K/V (the engine does, when it is built).

        ``threads(rows)``: the CPU thread count steps of that bucket will run on. A CPU program is built
        for the count it is traced under (and traced again under another), so warm-up must use the same.
        """
        from tqdm.auto import tqdm

        pairs = [(b, w) for b in self.batch_sizes for w in self.widths]
        caller = torch.get_num_threads()
        try:
            for rows, cols in tqdm(pairs, desc="compiling decode buckets", disable=not progress):
                count = threads(rows) if threads is not None else None
                if count is not None and count != torch.get_num_threads():
                    torch.set_num_threads(count)
                if self.kivi:  # its writes follow a step's plan, which a dummy step has not: trace, store nothing
                    self._call((rows, cols), *self._inputs((rows, cols)))
                    self.compiled.add((rows, cols))
                    continue
                zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
                self.run(zeros, zeros, torch.zeros(rows, cols, dtype=torch.int32, device=self.device),
                         torch.ones(rows, dtype=torch.int32, device=self.device), zeros, (rows, cols))
        finally:
            if torch.get_num_threads() != caller:
                torch.set_num_threads(caller)


__all__ = [
    "AdaptiveRows",
    "CompiledDecode",
    "StaticDecodeCache",
    "bucket_sizes",
    "compiling_in_background",
    "cpu_decode_attention",
    "decode_attention_with_new",
]
