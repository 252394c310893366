"""The paged KV pool: per layer, K and V stored in fixed-size blocks that any sequence can own.

Blocks can also leave and enter the pool whole: :meth:`PagedKVPool.export_blocks` packs a list of
blocks into one contiguous tensor per layer (what a prefill worker sends), and
:meth:`PagedKVPool.import_blocks` writes such tensors into other block ids (what a decode worker
receives). The :class:`~minipd.kv.spec.KVSpec` travels with them, so both ends agree on the format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minipd.kv.quant import FORMATS, QuantizedLayerCache
from minipd.kv.spec import KVSpec


@dataclass
class PackedKV:
    """Blocks taken out of a pool: for each layer, K and V of the blocks as one tensor.

    ``layers[i]`` is ``(2, num_blocks, block_size, kv_heads, head_dim)`` (K then V), and
    ``scales[i]`` the matching ``(2, num_blocks, *scale_shape)`` for quantized specs.
    ``num_tokens`` says how many leading token slots hold K/V (the last block may be partial).
    """

    spec: KVSpec
    num_tokens: int
    layers: list[torch.Tensor]
    scales: list[torch.Tensor] | None = None

    @property
    def num_blocks(self) -> int:
        """How many blocks were packed."""
        return self.layers[0].shape[1] if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes of values and scales."""
        return sum(t.nbytes for t in self.layers) + sum(t.nbytes for t in self.scales or ())


class PagedKVPool:
    """K and V for every layer, shaped (num_layers, num_blocks, block_size, kv_heads, head_dim)."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str) -> None:
        shape = (spec.num_layers, num_blocks, *spec.block_shape)
        self.spec = spec
        zero = FORMATS[spec.quant].zero if spec.quant else 0  # what decodes to 0.0
        self.k = torch.full(shape, zero, dtype=spec.dtype, device=device)
        self.v = torch.full(shape, zero, dtype=spec.dtype, device=device)
        self.k_scale = self.v_scale = None
        if spec.scale_dtype is not None:
            scale_shape = (spec.num_layers, num_blocks, *spec.scale_shape)
            self.k_scale = torch.ones(scale_shape, dtype=spec.scale_dtype, device=device)
            self.v_scale = torch.ones(scale_shape, dtype=spec.scale_dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = spec.block_size

    def layer(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V caches as the kernels take them: the tensors themselves, or, for a
        quantized pool, views that dequantize to ``dtype`` when read and quantize when written."""
        if self.spec.quant is None:
            return self.k[layer], self.v[layer]
        fmt = FORMATS[self.spec.quant]
        return (QuantizedLayerCache(self.k[layer], self.k_scale[layer], fmt, dtype),  # type: ignore[index]
                QuantizedLayerCache(self.v[layer], self.v_scale[layer], fmt, dtype))  # type: ignore[index]

    def keys(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The keys of ``block_ids`` in every layer, as floats: ``(blocks, layers, block_size, heads, dim)``."""
        layers = [self.layer(i, torch.float32)[0][block_ids] for i in range(self.spec.num_layers)]
        return torch.stack(layers, dim=1).float()

    def keys_shape(self, block_ids: torch.Tensor) -> torch.Tensor:
        """A ``meta`` tensor shaped like :meth:`keys` would return: the shape without the work."""
        spec = self.spec
        return torch.empty((len(block_ids), spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim),
                           device="meta")

    @property
    def num_tokens(self) -> int:
        """How many tokens the pool holds when every block is full."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes taken by K and V (and their scales) together."""
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes  # type: ignore[union-attr]
        return self.k.nbytes + self.v.nbytes + scales

    def export_blocks(self, block_ids: Sequence[int], num_tokens: int) -> PackedKV:
        """Copy ``block_ids`` out, one packed ``(2, n, block_size, heads, dim)`` tensor per layer."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.k.device)
        layers = [torch.stack((self.k[layer, index], self.v[layer, index])) for layer in range(self.spec.num_layers)]
        scales = None
        if self.k_scale is not None:
            scales = [torch.stack((self.k_scale[layer, index], self.v_scale[layer, index]))  # type: ignore[index]
                      for layer in range(self.spec.num_layers)]
        return PackedKV(self.spec, num_tokens, layers, scales)

    def import_blocks(self, block_ids: Sequence[int], packed: PackedKV) -> None:
        """Write ``packed`` into ``block_ids`` (as many as it has blocks); the formats must match."""
        if packed.spec != self.spec:
            raise ValueError(f"KV format mismatch: received {packed.spec.to_dict()}, this pool holds "
                             f"{self.spec.to_dict()}")
        if len(block_ids) != packed.num_blocks:
            raise ValueError(f"received {packed.num_blocks} blocks but {len(block_ids)} block ids to fill")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.k.device)
        for layer, kv in enumerate(packed.layers):
            self.k[layer, index] = kv[0].to(self.k.device)
            self.v[layer, index] = kv[1].to(self.v.device)
        if self.k_scale is not None and packed.scales is not None:
            for layer, sc in enumerate(packed.scales):
                self.k_scale[layer, index] = sc[0].to(self.k_scale.device)
                self.v_scale[layer, index] = sc[1].to(self.v_scale.device)  # type: ignore[index]
