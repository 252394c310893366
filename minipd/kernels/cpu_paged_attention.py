"""Paged attention as C++ CPU kernels that read the pool in place (``kernel_backend="cpu"``): decode and prefill.

The torch references (:mod:`minipd.kernels.paged_attention`) gather every sequence's blocks into
contiguous (decode: padded) tensors and run SDPA: a copy of the whole context per layer per step.
These kernels walk each sequence's block table instead and keep a running (online) softmax per query
row, one block of keys at a time, so K and V are read once, where they lie. The query heads sharing
a KV head (grouped-query attention) are served together, so each K/V row is loaded once for the group.

- :func:`paged_decode_attention_cpu`: one query per sequence; work is split over (sequence, KV head)
  pairs with ``at::parallel_for``. The new token's K/V may be passed separately (``k_new``, ``v_new``)
  instead of read from the pool, for a compiled decode step that must not write the pool. A bf16 or fp16
  pool (a model loaded in that dtype, or ``kv_cache_dtype="fp16"``) is read in place too, each chunk of rows
  widened to fp32 once fetched: half the bytes of an fp32 pool, the same arithmetic.
- :func:`paged_prefill_attention_cpu`: every sequence's chunk of queries in one call, causal, with an
  optional sliding window. Work items are (sequence, KV head, tile of queries), costliest first, taken
  one at a time by each thread, so one long prompt still uses every core. A tile's query rows (its
  queries times the group's heads) share each K/V row loaded; blocks no query of the tile sees are
  skipped; scores and outputs are accumulated in register-sized panels, and the exponential is a
  polynomial (``std::exp`` is a scalar call).

On a CPU with AVX2 and FMA (every x86 server CPU of the last decade) the exponential runs eight lanes at
a time in intrinsics, and decode takes its keys 64 at a time: scores as dot products reduced eight keys
together, values summed for up to four query heads per load. GCC 12 left the polynomial's loop scalar,
which was over half of both kernels' time; on the 2-core AVX2 EPYC this made decode attention ~2x and
prefill attention ~2.5x faster (``tests/test_cpu_paths.py`` and ``tests/test_cpu_kernels.py`` compare
both paths with the torch references).

The same extension carries the panel linears of :mod:`minipd.kernels.cpu_linear` (``linear_backend="cpu"``,
:file:`cpu_panel_linear.cpp`): one build, one import. They are compiled with
``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja needed; the build is cached under
``~/.cache/torch_extensions``, in a folder named by a hash of everything the build depends on — source, flags,
compiler, torch's version and location, Python's, the CPU's features — so two checkouts or virtualenvs on one
machine keep their builds side by side instead of rebuilding each other's): by ``make install``, by ``python
-m minipd build-kernels``, or on first use of ``kernel_backend="cpu"``. A process with
``MINIPD_NO_KERNEL_BUILD=1`` (every prefill/decode worker) never compiles: it imports a build that is there,
else uses the torch references, with a warning. The default backend on a CPU is this one once it is built, the
torch reference before. When it cannot be built, :func:`load_kernel` says why. They handle fp32 queries over
an fp32 cache; anything else (fp16 caches, quantized pools, other devices) goes to the references. """

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

from minipd.kernels.isa import cpu_flags, kernel_cflags, kernel_isa
from minipd.kernels.kv_store import store_kv_torch
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch

logger = logging.getLogger("minipd")

#: The extension's name; its folder in torch's extension cache adds :func:`build_key`.
_NAME = "minipd_cpu_paged_attention"
#: Linker flags of the build (the compiler's follow the instruction set it is built for: :mod:`minipd.kernels.isa`).
_LDFLAGS = ("-fopenmp",)
#: Set (to anything but "" or "0") where a build must not start: the kernel is used if built, else not.
NO_BUILD_ENV = "MINIPD_NO_KERNEL_BUILD"

#: The C++ sources (beside this file, so that they read as C++), compiled together by load_inline into one
#: extension: the panel linears of :mod:`minipd.kernels.cpu_linear` (first: they define what both use), the
#: attention kernels, SwiGLU's fused activation (after them: it uses the attention's exp), and the one-pass
#: RMSNorm and RoPE of :mod:`minipd.kernels.cpu_norm_rope`.
_SOURCE = "\n" + "\n".join((Path(__file__).parent / name).read_text()
                            for name in ("cpu_panel_linear.cpp", "cpu_paged_attention.cpp", "cpu_swiglu.cpp",
                                         "cpu_norm_rope.cpp"))


def _cpu_features() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (Linux), else the processor's name."""
    flags = cpu_flags()
    return " ".join(sorted(flags)) if flags else platform.processor() or platform.machine()


def toolchain() -> tuple[str, ...]:
    """What the build depends on besides the source and flags: the compiler, torch's and Python's versions
    and include folders (torch's differ per virtualenv, and torch writes them into the build's command
    line, so two virtualenvs sharing a folder rebuild each other's), the machine and its CPU features."""
    return (os.environ.get("CXX", "c++"), torch.__version__, os.path.dirname(torch.__file__),
            sys.version.split()[0], sysconfig.get_paths().get("include", ""), platform.machine(), _cpu_features())


def build_key(source: str = _SOURCE, cflags: Sequence[str] | None = None, ldflags: Sequence[str] = _LDFLAGS,
              tools: Sequence[str] | None = None) -> str:
    """A short hash of everything the build depends on: the source, the flags (``cflags``: by default those of the
    instruction set ``MINIPD_CPU_ISA`` asks for) and the :func:`toolchain` (``tools``, this process's by default).
    Equal inputs share one build; different ones never evict each other."""
    cflags = kernel_cflags() if cflags is None else cflags
    parts = [source, " ".join(cflags), " ".join(ldflags), *(toolchain() if tools is None else tools)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def extension_name() -> str:
    """The extension's name in torch's cache: :data:`_NAME` and :func:`build_key`."""
    return f"{_NAME}_{build_key()}"


def _no_build() -> bool:
    return os.environ.get(NO_BUILD_ENV, "") not in ("", "0")


def _built_library() -> Path | None:
    """The built extension for this key in torch's extension cache, or None (nothing is compiled to find out)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = extension_name()
    try:
        library = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    except Exception:
        return None
    return library if library.is_file() else None


def _import_built(library: Path) -> object:
    """Import a finished build as it is. ``load_inline`` would run ninja, which may compile."""
    spec = importlib.util.spec_from_file_location(library.stem, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_kernel() -> tuple[object | None, str | None]:
    """``(module, None)`` once the kernels are built (or loaded from the cache), else ``(None, why not)``.

    With ``MINIPD_NO_KERNEL_BUILD`` set, nothing is compiled: a build for this key is imported as it is,
    and a missing one is ``(None, why)``, with a warning. ``MINIPD_CPU_ISA`` chooses the instruction set
    (:mod:`minipd.kernels.isa`); a value it does not allow raises ``ValueError``, here and in :func:`kernel_built`."""
    kernel_isa()  # (a bad MINIPD_CPU_ISA is the user's to fix, not a reason to fall back quietly)
    try:
        if _no_build():
            library = _built_library()
            if library is None:
                reason = (f"not built for this source, torch and Python, and {NO_BUILD_ENV} forbids building here "
                          "(run `python -m minipd build-kernels` once)")
                logger.warning("the CPU paged-attention kernels are %s; using the torch references", reason)
                return None, reason
            module = _import_built(library)
        else:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(extension_name(), cpp_sources=[_SOURCE],
                                 functions=["paged_decode", "paged_prefill", "pack_panels", "panel_linear",
                                            "silu_mul", "rms_norm_f32", "add_rms_norm_f32", "rotary_f32",
                                            "compiled_isa"],
                                 extra_cflags=list(kernel_cflags()), extra_ldflags=list(_LDFLAGS), verbose=False)
        # Their shape rules, for tracing: decode's output is shaped like the queries; a linear's is (rows, features).
        torch.library.register_fake("minipd_cpu::paged_decode")(lambda q, *args: torch.empty_like(q))
        torch.library.register_fake("minipd_cpu::panel_linear")(
            lambda x, panels, bias, out_features: x.new_empty(x.shape[0], out_features))
        return module, None
    except Exception as err:  # no compiler, no ninja, a sandbox without write access...
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        logger.info("the CPU paged-attention kernels could not be built (%s); using the torch references", reason)
        return None, reason


def kernel_built() -> bool:
    """Whether a build of the kernels for this key is already in torch's extension cache (nothing is compiled
    to find out).

    The engine picks the kernels by default only then: a first build takes a minute, which ``make install``
    (or ``python -m minipd build-kernels``) pays once, never a reader's first ``LLM(...)``.
    """
    return _built_library() is not None


#: Stands for "no new K/V rows" in a call of the C++ decode (it takes tensors, not None).
_NO_ROWS = torch.empty(0)


def _takes(*tensors: object) -> bool:
    """Whether the kernels read these as they are: plain fp32 CPU tensors (no quantized pool objects)."""
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
               and t.layout == torch.strided for t in tensors)


#: Pool dtypes the decode kernel reads besides fp32 (widening each row as it is fetched).
NARROW_POOL_DTYPES = (torch.bfloat16, torch.float16)


def _decode_takes(q: torch.Tensor, k_cache: object, v_cache: object, *rows: torch.Tensor) -> bool:
    """Whether the decode kernel reads these as they are: fp32 throughout, or bf16/fp16 caches (both alike) with
    queries and new rows in fp32 or the caches' dtype (plain CPU tensors: no quantized pool objects)."""
    if _takes(q, k_cache, v_cache, *rows):
        return True
    tensors = (q, k_cache, v_cache, *rows)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided for t in tensors):
        return False
    pool = k_cache.dtype  # type: ignore[union-attr]
    return (pool in NARROW_POOL_DTYPES and v_cache.dtype == pool and q.dtype in (torch.float32, pool)  # type: ignore[union-attr]
            and len({t.dtype for t in rows}) <= 1 and all(t.dtype in (torch.float32, pool) for t in rows))


def _window(sliding_window: int | None) -> int:
    return 0 if sliding_window is None else int(sliding_window)


def _as_index(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, *,
                               context_lens_host: Sequence[int] | None = None,
                               k_new: torch.Tensor | None = None,
                               v_new: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`~minipd.kernels.paged_attention.paged_decode_attention_torch`, reading the pool in place.

    With ``k_new`` and ``v_new`` (B, kv_heads, head_dim), each sequence's last position
    (``context_lens[b] - 1``) is taken from them instead of the pool, whose slot for it may hold anything;
    the pool is read for the positions before it only. So a decode step can attend before (or without)
    storing its token. Every length must then be at least 1.

    The pool may be fp32, bf16 or fp16 (its rows widened to fp32 as they are read; queries and new rows in fp32
    or the pool's dtype, the result in the queries'). Falls back to the reference for what the kernel does not
    take (other dtypes, non-CPU tensors, a pool that is not a plain tensor, or no compiled kernel); with
    ``k_new`` the fallback stores the new rows into a copy of the pool first (slow, but the same answer as
    storing, then attending).
    """
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    module, _ = load_kernel()
    rows = () if k_new is None else (k_new, v_new)
    if module is None or not _decode_takes(q, k_cache, v_cache, *rows) or q.shape[1] % k_cache.shape[2]:
        if k_new is not None and v_new is not None:
            k_cache, v_cache = _with_new_rows(k_cache, v_cache, block_tables, context_lens, k_new, v_new)
        return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                            context_lens_host=context_lens_host)
    # New rows are taken as the pool would keep them: a bf16/fp16 pool rounds them to its dtype when stored.
    keep = k_cache.dtype  # type: ignore[union-attr]
    k_rows = _NO_ROWS if k_new is None else k_new.to(keep).contiguous()
    v_rows = _NO_ROWS if v_new is None else v_new.to(keep).contiguous()
    return module.paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),  # type: ignore[attr-defined]
                               _as_index(block_tables), _as_index(context_lens), float(scale),
                               _window(sliding_window), k_rows, v_rows)


def _with_new_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with each sequence's last position holding its ``k_new``/``v_new`` row."""
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        raise TypeError("k_new/v_new need plain tensor caches; a quantized pool stores its new rows first")
    block_size = k_cache.shape[1]
    last = context_lens.to(device=block_tables.device, dtype=torch.int64) - 1
    if bool((last < 0).any()):
        raise ValueError("with k_new every context holds at least the new token (context_lens >= 1)")
    blocks = block_tables.to(torch.int64).gather(1, (last // block_size)[:, None]).squeeze(1)
    slots = (blocks * block_size + last % block_size).to(k_cache.device)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    store_kv_torch(k_new, v_new, k_copy, v_copy, slots, has_padding=False)
    return k_copy, v_copy


def paged_prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                sliding_window: int | None = None, *,
                                query_start_host: Sequence[int] | None = None,
                                context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """As :func:`~minipd.kernels.paged_attention.paged_prefill_attention_torch`, in one call that reads the
    pool in place.

    The host lists are not needed (the kernel reads the CPU tensors directly); they are passed on to
    the reference when it falls back to it, for the same reasons as :func:`paged_decode_attention_cpu`.
    """
    module, _ = load_kernel()
    if module is None or not _takes(q, k_cache, v_cache) or q.shape[1] % k_cache.shape[2]:
        return paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                             sliding_window, query_start_host=query_start_host,
                                             context_lens_host=context_lens_host)
    return module.paged_prefill(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),  # type: ignore[attr-defined]
                                _as_index(block_tables), _as_index(query_start_loc), _as_index(context_lens),
                                float(scale), _window(sliding_window))


__all__ = ["kernel_built", "load_kernel", "paged_decode_attention_cpu", "paged_prefill_attention_cpu"]
