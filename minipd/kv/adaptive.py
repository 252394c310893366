"""Adaptive KV precision (``kv_cache_dtype="adaptive"``): full precision while there is room, codes after.

The pool is an arena of *pages*, each the bytes of one full-precision block. A page holds either one
full-precision block or ``ratio`` compressed ones: an int8 block's codes are exactly a quarter of an
fp32 block's bytes (half an fp16 one's), so four int8 blocks are the same bytes viewed as int8; their
scales live in a side table with room for every page split. The kernels need nothing new: the same
memory is handed to them as a float pool (block id = page) or as a quantized one (block id = page *
ratio + part), and each request's blocks all come in one format.

Which format a request gets is decided when it is admitted: full precision while the pool's usage is
below ``high``, compressed from then on, full again once usage falls below ``low`` (the gap keeps it
from flapping). When a running request needs a block and none is free, the engine first *compresses*
a full-precision request in place (its pages become a quarter as many bytes of codes, its work kept)
and preempts only when no full-precision request is left; a preempted one is decided afresh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from minipd.kv.block_manager import BlockAllocation, PrefixCacheStats
from minipd.kv.paged_pool import PagedKVPool
from minipd.kv.quant import FORMATS, QuantizedLayerCache
from minipd.kv.spec import KVSpec


class AdaptiveBlockManager:
    """Hands out pages whole (full precision) or in ``ratio`` parts (compressed); see the module docstring.

    It answers the scheduler as :class:`~minipd.kv.block_manager.BlockManager` does, without prefix
    caching. A request's format is ``alloc.compressed`` (None until its first blocks).
    """

    enable_prefix_caching = False

    def __init__(self, num_pages: int, block_size: int, ratio: int, low: float, high: float) -> None:
        if num_pages < 1 or ratio < 2:
            raise ValueError(f"need at least one page and a ratio of at least 2, got {num_pages} and {ratio}")
        self.num_blocks = num_pages  # in pages: what a full-precision request can count on
        self.block_size, self.ratio, self.low, self.high = block_size, ratio, low, high
        self.free_pages = list(range(num_pages - 1, -1, -1))
        #: Split pages with free parts: page -> its free part indices.
        self.open_parts: dict[int, list[int]] = {}
        self.used_parts: dict[int, int] = {}  # split page -> parts in use
        self.stats = PrefixCacheStats()
        self.evictions = 0
        #: What a request admitted now gets, and how often that changed.
        self.compressing = False
        self.num_switches = 0
        #: Requests admitted in each format so far, and running ones compressed to make room.
        self.admitted = {False: 0, True: 0}
        self.num_compressions = 0

    # ---------------------------------------------------------------------------------- usage
    @property
    def usage(self) -> float:
        """Fraction of the arena's bytes in use (a split page counts its used parts)."""
        used = self.num_blocks - len(self.free_pages) - len(self.used_parts)
        return (used + sum(self.used_parts.values()) / self.ratio) / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free pages (each one full-precision block, or ``ratio`` compressed ones)."""
        return len(self.free_pages)

    @property
    def num_used_blocks(self) -> int:
        """Pages holding something."""
        return self.num_blocks - len(self.free_pages)

    def _update_mode(self) -> bool:
        """Follow the usage (with hysteresis) after every change; return the format a newcomer gets now."""
        usage = self.usage
        now = usage >= self.high if not self.compressing else usage >= self.low
        if now != self.compressing:
            self.compressing = now
            self.num_switches += 1
        return now

    # ----------------------------------------------------------------------------- allocation
    def find_cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> list[int]:
        return []

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens

    def register_full_blocks(self, *args: object, **kwargs: object) -> None:
        """Nothing to register: no prefix caching here."""

    def blocks_needed(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> int:
        """Fresh blocks (of the request's format) required to cover ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(alloc.block_table))

    def _room(self, compressed: bool) -> int:
        if not compressed:
            return len(self.free_pages)
        return sum(map(len, self.open_parts.values())) + self.ratio * len(self.free_pages)

    def can_allocate(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` would succeed."""
        compressed = alloc.compressed if alloc.compressed is not None else self.compressing
        return self.blocks_needed(alloc, num_tokens) <= self._room(compressed)

    def allocate(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Grow ``alloc`` to ``num_tokens`` tokens in its format (chosen now for a new request); False, changing
        nothing, when there is no room."""
        if cached_prefix:
            raise ValueError("adaptive KV precision does not share prefix blocks")
        fresh = alloc.compressed is None
        compressed = self._update_mode() if fresh else alloc.compressed
        needed = self.blocks_needed(alloc, num_tokens)
        if needed > self._room(compressed):
            return False
        if fresh:
            alloc.compressed = compressed
            self.admitted[compressed] += 1
        for _ in range(needed):
            alloc.block_table.append(self._take_part() if compressed else self.free_pages.pop())
        self._update_mode()
        return True

    def _take_part(self) -> int:
        if not self.open_parts:  # split a free page
            page = self.free_pages.pop()
            self.open_parts[page] = list(range(self.ratio - 1, -1, -1))
            self.used_parts[page] = 0
        # The page most used first, so that pages empty out and return whole.
        page = max(self.open_parts, key=self.used_parts.__getitem__)
        part = self.open_parts[page].pop()
        if not self.open_parts[page]:
            del self.open_parts[page]
        self.used_parts[page] += 1
        return page * self.ratio + part

    def free_blocks(self, alloc: BlockAllocation) -> None:
        """Give back every block of ``alloc``; its format is decided afresh next time."""
        for block in alloc.block_table:
            if not alloc.compressed:
                self.free_pages.append(block)
                continue
            page, part = divmod(block, self.ratio)
            self.used_parts[page] -= 1
            if self.used_parts[page] == 0:  # the page is whole again
                del self.used_parts[page]
                self.open_parts.pop(page, None)
                self.free_pages.append(page)
            else:
                self.open_parts.setdefault(page, []).append(part)
        alloc.block_table.clear()
        alloc.committed_hashes.clear()
        alloc.compressed = None
        self._update_mode()

    def compress(self, alloc: BlockAllocation) -> tuple[list[int], list[int]]:
        """Move a full-precision request to compressed blocks: free its pages, take as many parts.

        Returns ``(pages, parts)``; the caller must copy page ``pages[i]`` into part ``parts[i]`` (from a copy
        taken before this call: a part may sit in one of the freed pages).
        """
        if alloc.compressed is not False:
            raise ValueError("only a full-precision request can be compressed")
        pages = list(alloc.block_table)
        self.free_blocks(alloc)
        alloc.compressed = True
        for _ in pages:
            alloc.block_table.append(self._take_part())
        self.num_compressions += 1
        return pages, list(alloc.block_table)

    def pin(self, block_ids: Sequence[int]) -> BlockAllocation:
        raise ValueError("adaptive KV precision cannot pin blocks for another worker (no PD transfer yet)")

    def drop_blocks(self, alloc: BlockAllocation, indices: Sequence[int], num_computed: int) -> None:
        raise ValueError("adaptive KV precision does not combine with token eviction")


class AdaptiveKVPool(PagedKVPool):
    """A float pool whose pages can also be read and written as ``ratio`` blocks of a quantized format.

    ``spec`` is the full-precision format (its blocks are the pages); ``compressed`` the quantized one.
    The codes of compressed block ``page * ratio + part`` are bytes of page ``page``; their scales are
    in ``part_k_scale``/``part_v_scale``, sized for every page split.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: torch.device | str, compressed: KVSpec) -> None:
        super().__init__(spec, num_pages, device)
        self.compressed_spec = compressed
        self.ratio = adaptive_ratio(spec, compressed)
        self.fmt = FORMATS[compressed.quant]  # type: ignore[index]
        shape = (spec.num_layers, num_pages * self.ratio, *compressed.scale_shape)
        self.part_k_scale = torch.ones(shape, dtype=compressed.scale_dtype, device=device)
        self.part_v_scale = torch.ones(shape, dtype=compressed.scale_dtype, device=device)

    def compressed_layer(self, layer: int, dtype: torch.dtype) -> tuple[QuantizedLayerCache, QuantizedLayerCache]:
        """Layer ``layer`` seen as the compressed format: block ids are ``page * ratio + part``."""
        shape = (self.num_blocks * self.ratio, *self.compressed_spec.block_shape)
        storage = self.compressed_spec.dtype
        return (QuantizedLayerCache(self.k[layer].view(storage).view(shape), self.part_k_scale[layer], self.fmt, dtype),
                QuantizedLayerCache(self.v[layer].view(storage).view(shape), self.part_v_scale[layer], self.fmt,
                                    dtype))

    def compress_pages(self, pages: list[int], parts: list[int]) -> None:
        """Quantize full-precision ``pages`` into compressed blocks ``parts`` (which may lie in those pages)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        target = torch.tensor(parts, dtype=torch.long, device=self.k.device)
        values = [(self.k[layer, index].clone(), self.v[layer, index].clone()) for layer in range(self.spec.num_layers)]
        for layer, (k, v) in enumerate(values):
            for cache, x in zip(self.compressed_layer(layer, k.dtype), (k, v), strict=True):
                codes, scales = self.fmt.quantize(x)
                cache.codes[target], cache.scales[target] = codes, scales

    @property
    def nbytes(self) -> int:
        """Bytes of the pages and of the compressed blocks' scales."""
        return super().nbytes + self.part_k_scale.nbytes + self.part_v_scale.nbytes

    @staticmethod
    def page_bytes(spec: KVSpec, compressed: KVSpec) -> int:
        """What one page costs: a full-precision block and the scales of its compressed parts."""
        scales = compressed.bytes_per_block - 2 * compressed.num_layers * math.prod(compressed.block_shape) * \
            compressed.dtype.itemsize
        return spec.bytes_per_block + adaptive_ratio(spec, compressed) * scales


def adaptive_ratio(spec: KVSpec, compressed: KVSpec) -> int:
    """Compressed blocks in the bytes of one ``spec`` block (e.g. 4 int8 blocks in an fp32 one)."""
    if not compressed.is_quantized or compressed.has_residual_window:
        raise ValueError(f"kv_adaptive_format must be a per-token quantized format ('int8', 'fp8', "
                         f"'int4_per_token'), got {compressed.quant or compressed.dtype}")
    full = spec.dtype.itemsize * math.prod(spec.block_shape)
    part = compressed.dtype.itemsize * math.prod(compressed.block_shape)
    if full % part or full // part < 2:
        raise ValueError(f"a {spec.dtype} block does not split into whole {compressed.quant} blocks")
    return full // part
