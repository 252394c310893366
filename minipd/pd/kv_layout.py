"""How a worker's KV blocks look to a transport: the pool's tensors, the address layout another worker needs
to read or write them, and the two wire formats blocks travel in — raw (as the pool stores them) or
quantized for the wire only (``kv_transfer_dtype``). The transports that move them: :mod:`minipd.pd.transport`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minipd.kv.paged_pool import PagedKVPool


def pool_tensors(pool: PagedKVPool) -> list[torch.Tensor]:
    """Every tensor a block lives in, each shaped ``(num_layers, num_blocks, ...)``: K and V, and for a
    quantized pool their scales (codes without scales are useless, so they always travel together)."""
    tensors = [pool.k, pool.v]
    if pool.k_scale is not None:
        tensors += [pool.k_scale, pool.v_scale]
    return tensors


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool's blocks are in memory: in each of its tensors (K, V, and scales when quantized),
    block ``b`` of layer ``l`` starts ``(l * num_blocks + b)`` block-sizes after the tensor's base
    address. Sent to peers so they can address blocks they do not own."""

    regions: tuple[tuple[int, int], ...]  # (base address, bytes of one block of one layer) per tensor
    num_layers: int
    num_blocks: int
    device_id: int
    mem_type: str

    @classmethod
    def of(cls, pool: PagedKVPool) -> PoolLayout:
        """The layout of ``pool`` (its tensors must be contiguous)."""
        tensors = pool_tensors(pool)
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError("the KV pool must be contiguous to be registered for transfer")
        cuda = pool.k.device.type == "cuda"
        device_id = (pool.k.device.index or 0) if cuda else 0
        return cls(tuple((t.data_ptr(), t[0, 0].nbytes) for t in tensors), pool.k.shape[0], pool.k.shape[1],
                   device_id, "VRAM" if cuda else "DRAM")

    @property
    def block_bytes(self) -> tuple[int, ...]:
        """Bytes of one block of one layer in each tensor (two peers must agree on them)."""
        return tuple(size for _, size in self.regions)

    def descriptors(self, block_ids: list[int], layers: list[int] | None = None) -> np.ndarray:
        """(tensors * layers * blocks, 3) rows of (address, length, device) for these blocks (all layers by
        default), tensor by tensor."""
        blocks = np.asarray(block_ids, dtype=np.uint64)
        chosen = np.asarray(range(self.num_layers) if layers is None else layers, dtype=np.uint64)
        index = (chosen[:, None] * np.uint64(self.num_blocks) + blocks[None, :]).reshape(-1)
        rows = np.empty((len(self.regions) * index.size, 3), dtype=np.uint64)
        for i, (address, size) in enumerate(self.regions):
            part = rows[i * index.size:(i + 1) * index.size]
            part[:, 0], part[:, 1], part[:, 2] = np.uint64(address) + index * np.uint64(size), size, self.device_id
        return rows


def pack_blocks(tensors: list[torch.Tensor], layers: slice, index: torch.Tensor) -> torch.Tensor:
    """The blocks ``index`` of ``layers`` of every tensor, as one flat byte tensor (a message's payload)."""
    return torch.cat([t[layers, index].contiguous().view(torch.uint8).reshape(-1) for t in tensors])


def packed_size(tensors: list[torch.Tensor], num_layers: int, num_blocks: int) -> int:
    """Bytes :func:`pack_blocks` gives for ``num_layers`` layers of ``num_blocks`` blocks."""
    return sum(num_layers * num_blocks * t[0, 0].nbytes for t in tensors)


def unpack_blocks(tensors: list[torch.Tensor], layers: slice, index: torch.Tensor, payload: torch.Tensor) -> None:
    """Write a :func:`pack_blocks` payload into the blocks ``index`` of ``layers`` of every tensor."""
    offset = 0
    for t in tensors:
        target = t[layers, index]
        size = target.numel() * t.element_size()
        t[layers, index] = payload[offset:offset + size].view(t.dtype).view(target.shape)
        offset += size


class RawBlocks:
    """Blocks on the wire exactly as the pool stores them (codes and scales for a quantized pool)."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.tensors = pool_tensors(pool)
        #: Bytes of one block, every layer, K and V, as sent.
        self.bytes_per_block = packed_size(self.tensors, pool.k.shape[0], 1)

    def pack(self, layers: slice, index: torch.Tensor) -> torch.Tensor:
        return pack_blocks(self.tensors, layers, index)

    def size(self, num_layers: int, num_blocks: int) -> int:
        return packed_size(self.tensors, num_layers, num_blocks)

    def unpack(self, layers: slice, index: torch.Tensor, payload: torch.Tensor) -> None:
        unpack_blocks(self.tensors, layers, index, payload)


class QuantizedWire:
    """Blocks of a float pool quantized for the wire only (``kv_transfer_dtype``): the sender sends codes
    and a scale per token per KV head, the receiver writes their values back into its float pool. The
    bytes shrink as they would in a quantized pool; the K/V land rounded to the format."""

    def __init__(self, pool: PagedKVPool, format_name: str) -> None:
        from minipd.kv.quant import FORMATS, PER_TOKEN_FORMATS

        if pool.spec.is_quantized:
            raise ValueError("kv_transfer_dtype compresses a float pool on the wire; this pool is already "
                             f"{pool.spec.quant}")
        if pool.spec.latent:
            raise ValueError("kv_transfer_dtype quantizes per-head K/V for the wire; this model uses multi-head "
                             "latent attention and its pool holds compressed latents")
        if format_name not in PER_TOKEN_FORMATS:
            raise ValueError(f"kv_transfer_dtype must be one of {', '.join(map(repr, PER_TOKEN_FORMATS))}, "
                             f"got {format_name!r}")
        self.pool, self.fmt = pool, FORMATS[format_name]
        spec = pool.spec
        self.row = spec.num_kv_heads * spec.head_dim // self.fmt.pack  # code bytes of one token of one layer
        self.bytes_per_block = self.size(spec.num_layers, 1)

    def size(self, num_layers: int, num_blocks: int) -> int:
        spec = self.pool.spec
        tokens = num_layers * num_blocks * spec.block_size
        return 2 * tokens * (self.row + 2 * spec.num_kv_heads)  # K and V: codes and fp16 scales

    def pack(self, layers: slice, index: torch.Tensor) -> torch.Tensor:
        parts = []
        for cache in (self.pool.k, self.pool.v):
            codes, scales = self.fmt.quantize(cache[layers, index])
            parts += [t.contiguous().view(torch.uint8).reshape(-1) for t in (codes, scales)]
        return torch.cat(parts)

    def unpack(self, layers: slice, index: torch.Tensor, payload: torch.Tensor) -> None:
        spec, offset = self.pool.spec, 0
        for cache in (self.pool.k, self.pool.v):
            target = cache[layers, index]  # (layers, blocks, block_size, heads, dim)
            codes_shape = (*target.shape[:-1], spec.head_dim // self.fmt.pack)
            size = int(np.prod(codes_shape))
            codes = payload[offset:offset + size].view(self.fmt.storage).view(codes_shape)
            offset += size
            scales = payload[offset:offset + 2 * size * self.fmt.pack // spec.head_dim].view(torch.float16)
            offset += scales.numel() * 2
            cache[layers, index] = self.fmt.dequantize(codes, scales.view(target.shape[:-1]), cache.dtype)


__all__ = ["PoolLayout", "QuantizedWire", "RawBlocks", "pack_blocks", "packed_size", "pool_tensors", "unpack_blocks"]
