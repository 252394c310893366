"""The KV format: how K and V are laid out in the pool, in one place.

A :class:`KVSpec` says what one block holds — its token count, element dtype, heads and head size,
and, for quantized formats, the scales stored beside the values. The pool allocates from it, the
kernels are checked against it, and a worker that receives blocks from another compares specs
before copying a byte. A new cache format (int8 with scales, say) is a new spec, not edits in the
pool, the runner and every kernel.

Multi-head latent attention (DeepSeek-V3) is such a format: the spec is ``latent``, K holds each
token's compressed latent and shared rope key as one "head" of ``kv_lora_rank + qk_rope_head_dim``,
and there is no V at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from minipd.config import ModelConfig
from minipd.kv.quant import FORMATS

#: Floating-point cache dtypes by name, as ``EngineConfig.kv_cache_dtype`` accepts them (vLLM's short
#: names too).
KV_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                      "bfloat16": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Every ``kv_cache_dtype``: the model's own dtype, a floating-point dtype, or a quantized format.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *KV_DTYPES, *FORMATS)


@dataclass(frozen=True)
class KVSpec:
    """How one layer's K (and likewise V) is stored: ``(num_blocks, block_size, kv_heads, head_dim)``.

    ``scale_shape``/``scale_dtype`` describe per-block scale tensors for quantized formats
    (empty/None for plain floating-point caches); they are allocated beside the values with shape
    ``(num_blocks, *scale_shape)`` per layer for V, and for K too unless ``k_scale_shape`` says
    otherwise (KIVI's per-channel key scales). ``quant`` names the code format
    (:data:`minipd.kv.quant.FORMATS`), None for floating-point caches.

    ``latent`` marks a multi-head latent attention cache: K is ``(num_blocks, block_size, 1, latent_dim)``,
    each row a token's normed latent then its rotated rope key, and V is empty (zero-width).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale_shape: tuple[int, ...] = ()
    scale_dtype: torch.dtype | None = None
    quant: str | None = None
    k_scale_shape: tuple[int, ...] | None = None
    latent: bool = False

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVSpec:
        """A plain floating-point cache of ``dtype`` for ``config``'s attention layers."""
        if config.is_mla:
            # One row per token: the latent and the rope key every head shares, no per-head K or V.
            return cls(config.num_hidden_layers, block_size, 1, config.kv_latent_dim, dtype, latent=True)
        return cls(config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim, dtype)

    @classmethod
    def from_name(cls, config: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> KVSpec:
        """The spec ``kv_cache_dtype`` names (one of :data:`KV_CACHE_DTYPES`) for ``config``'s layers."""
        if kv_cache_dtype in (None, "auto"):
            return cls.for_model(config, block_size, model_dtype)
        if kv_cache_dtype in KV_DTYPES:
            return cls.for_model(config, block_size, KV_DTYPES[kv_cache_dtype])
        if kv_cache_dtype not in FORMATS:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {kv_cache_dtype!r}")
        if config.is_mla:
            # The quantized formats (and KIVI, and adaptive precision, which compresses to one of them) keep
            # scales per KV head and per-head K/V; an MLA cache has neither.
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (as kv_cache_dtype, or as the kv_adaptive_format of "
                             "kv_cache_dtype='adaptive') quantizes per-head K/V, but this model uses multi-head "
                             "latent attention and caches a compressed latent per token instead; use "
                             "kv_cache_dtype='auto' or a floating-point dtype")
        if config.head_dim % FORMATS[kv_cache_dtype].pack:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} packs {FORMATS[kv_cache_dtype].pack} values a byte "
                             f"and needs an even head_dim; this model's is {config.head_dim}")
        fmt, heads = FORMATS[kv_cache_dtype], config.num_key_value_heads
        # One fp16 scale per token per KV head, beside the codes; KIVI's keys one per channel per block.
        return cls(config.num_hidden_layers, block_size, heads, config.head_dim, fmt.storage, (block_size, heads),
                   torch.float16, kv_cache_dtype, (heads, config.head_dim) if fmt.per_channel_keys else None)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of K (or V) in one layer, as stored (int4 packs two values a byte)."""
        pack = FORMATS[self.quant].pack if self.quant else 1
        return self.block_size, self.num_kv_heads, self.head_dim // pack

    @property
    def v_block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of V in one layer: :attr:`block_shape`, or zero-width for a latent cache."""
        return (self.block_size, self.num_kv_heads, 0) if self.latent else self.block_shape

    @property
    def is_quantized(self) -> bool:
        """True when values come with scales."""
        return self.scale_dtype is not None

    @property
    def key_scale_shape(self) -> tuple[int, ...]:
        """Shape of one block's K scales in one layer."""
        return self.scale_shape if self.k_scale_shape is None else self.k_scale_shape

    @property
    def has_residual_window(self) -> bool:
        """True for KIVI's format: filling blocks wait in full precision (see :mod:`minipd.kv.residual`)."""
        return self.quant is not None and FORMATS[self.quant].per_channel_keys

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, K and V, scales included."""
        values = (math.prod(self.block_shape) + math.prod(self.v_block_shape)) * _element_size(self.dtype)
        scales = 0
        if self.scale_dtype is not None:
            scales = (math.prod(self.key_scale_shape) + math.prod(self.scale_shape)) * _element_size(self.scale_dtype)
        return self.num_layers * (values + scales)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per cached token (a block's bytes over its tokens)."""
        return self.bytes_per_block / self.block_size

    def blocks_for_budget(self, memory_bytes: int) -> int:
        """How many blocks fit in ``memory_bytes`` (at least one)."""
        return max(1, memory_bytes // self.bytes_per_block)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (dtypes by name) for a handshake between workers."""
        raw = {"num_layers": self.num_layers, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
               "head_dim": self.head_dim, "dtype": str(self.dtype).removeprefix("torch."),
               "scale_shape": list(self.scale_shape),
               "scale_dtype": None if self.scale_dtype is None else str(self.scale_dtype).removeprefix("torch."),
               "quant": self.quant, "k_scale_shape": None if self.k_scale_shape is None else list(self.k_scale_shape)}
        if self.latent:  # only when set, so the dicts of every other format (and saved manifests) are unchanged
            raw["latent"] = True
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVSpec:
        """Inverse of :meth:`to_dict`."""
        scale = raw.get("scale_dtype")
        return cls(raw["num_layers"], raw["block_size"], raw["num_kv_heads"], raw["head_dim"],
                   getattr(torch, raw["dtype"]), tuple(raw.get("scale_shape", ())),
                   None if scale is None else getattr(torch, scale), raw.get("quant"),
                   None if raw.get("k_scale_shape") is None else tuple(raw["k_scale_shape"]),
                   bool(raw.get("latent", False)))


def _element_size(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype).element_size()
