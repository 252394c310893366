"""Paged decode attention as a C++ CPU kernel that reads the pool in place (``kernel_backend="cpu"``).

The torch reference (:func:`~minipd.kernels.paged_attention.paged_decode_attention_torch`) gathers
every sequence's blocks into padded tensors and runs masked SDPA: a copy of the whole context per
layer per step, plus the padding. This kernel walks each sequence's block table instead and keeps a
running (online) softmax per query head, one block of keys at a time, so K and V are read once,
where they lie. Work is split over (sequence, KV head) pairs with ``at::parallel_for``; the query
heads sharing a KV head (grouped-query attention) are served together, so each K/V row is loaded
once for the whole group.

It is compiled with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja needed; the
build is cached under ``~/.cache/torch_extensions``): by ``make install``, by
``python -m minipd build-kernels``, or on first use of ``kernel_backend="cpu"``. The default backend on
a CPU is this one once it is built, the torch reference before. When it cannot be built,
:func:`load_kernel` says why. It handles fp32 queries over
an fp32 cache; anything else (fp16 caches, quantized pools) goes to the reference.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from minipd.kernels.paged_attention import paged_decode_attention_torch

logger = logging.getLogger("minipd")

#: The extension's name (and its folder in torch's extension cache).
_NAME = "minipd_cpu_paged_attention"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// q (B, H, D), caches (N, block_size, KVH, D), tables (B, max_blocks) int64, lens (B) int64; fp32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t group = H / KVH, table_width = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = KVH * D, block_stride = bs * row;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * D), scores(group * bs), m(group), l(group);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kvh = idx % KVH, len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const float* qb = qp + (b * H + kvh * group) * D;
      for (int64_t start = first - first % bs; start < len; start += bs) {
        const int64_t block = tp[b * table_width + start / bs];
        const int64_t lo = std::max(start, first), hi = std::min(start + bs, len);
        const float* kb = kp + block * block_stride + kvh * D;
        const float* vb = vp + block * block_stride + kvh * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qb + g * D;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = lo; t < hi; ++t) {
            const float* k = kb + (t - start) * row;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
            dot *= fscale;
            scores[g * bs + (t - start)] = dot;
            block_max = std::max(block_max, dot);
          }
          // Rescale what was accumulated to the new running maximum, once per block.
          const float m_new = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - m_new);
          float* a = acc.data() + g * D;
          l[g] *= correction;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          for (int64_t t = lo; t < hi; ++t) {
            const float p = std::exp(scores[g * bs + (t - start)] - m_new);
            l[g] += p;
            const float* v = vb + (t - start) * row;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
          }
          m[g] = m_new;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (b * H + kvh * group + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}
"""


@functools.cache
def load_kernel() -> tuple[object | None, str | None]:
    """``(module, None)`` once the kernel is built (or loaded from the cache), else ``(None, why not)``."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(_NAME, cpp_sources=[_SOURCE], functions=["paged_decode"],
                             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                             verbose=False)
        return module, None
    except Exception as err:  # no compiler, no ninja, a sandbox without write access...
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        logger.info("the CPU paged-attention kernel could not be built (%s); using the torch reference", reason)
        return None, reason


def kernel_built() -> bool:
    """Whether a build of the kernel is already in torch's extension cache (nothing is compiled to find out).

    The engine picks the kernel by default only then: a first build takes a minute, which ``make install``
    (or ``python -m minipd build-kernels``) pays once, never a reader's first ``LLM(...)``.
    """
    from torch.utils.cpp_extension import _get_build_directory

    try:
        folder = Path(_get_build_directory(_NAME, verbose=False))
    except Exception:
        return False
    return any(folder.glob(f"{_NAME}*.so"))


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, *,
                               context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """As :func:`~minipd.kernels.paged_attention.paged_decode_attention_torch`, reading the pool in place.

    Falls back to the reference for what the kernel does not take (non-fp32 tensors, non-CPU tensors,
    a pool that is not a plain tensor, or no compiled kernel).
    """
    module, _ = load_kernel()
    plain = all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
                for t in (q, k_cache, v_cache))
    if module is None or not plain or q.shape[1] % k_cache.shape[2]:
        return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                            context_lens_host=context_lens_host)
    return module.paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),  # type: ignore[attr-defined]
                               block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous(),
                               float(scale), -1 if sliding_window is None else int(sliding_window))


__all__ = ["kernel_built", "load_kernel", "paged_decode_attention_cpu"]
