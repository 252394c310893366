"""Hands out fixed-size KV blocks, counts references, and remembers full blocks for prefix reuse.

A sequence's KV cache is a list of block ids, its *block table*. Blocks are shared between
sequences only through prefix caching: a full block is identified by a chained hash of its tokens
and of the block before it, so two sequences that start with the same tokens find the same blocks.
When a block's last user lets go it goes back to the free list but keeps its contents and hash, so
a later request can still hit it; it is really reused (evicted) only when a fresh block is needed,
least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Block:
    """One block of the pool: who uses it and, once full and cached, what it holds."""

    block_id: int
    ref_count: int = 0
    #: Chained hash of the tokens it holds, set once it is full and registered for reuse.
    block_hash: int | None = None
    #: The tokens it holds, kept to rule out hash collisions.
    token_ids: tuple[int, ...] = ()


#: Parent hash of a sequence's first block. A fixed integer, not None: hashes of ints and tuples of
#: ints are the same in every process, which moving blocks between workers relies on.
ROOT_HASH = 0


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Identity of a full block: its tokens and everything before it (through the parent's hash)."""
    return hash((ROOT_HASH if parent is None else parent, tuple(token_ids)))


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from cache (0 when nothing was looked up)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class BlockAllocation:
    """What the block manager holds for one sequence."""

    block_table: list[int] = field(default_factory=list)
    #: Hashes of the sequence's leading full blocks that are computed and registered.
    block_hashes: list[int] = field(default_factory=list)


class BlockManager:
    """Allocation, sharing and LRU eviction of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is taken first. Hashed blocks go to the back
        # (worth keeping), blocks with nothing reusable go to the front.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.stats = PrefixCacheStats()
        self.evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still hold reusable cached contents)."""
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids`` (whole blocks only).

        At least one token is always left to compute, since the last position's logits are needed
        to sample the next token.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        found: list[int] = []
        parent = None
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            tokens = tuple(token_ids[start:start + bs])
            parent = chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one prompt's prefix-cache lookup in the hit-rate statistics."""
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens

    def blocks_needed(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> int:
        """Fresh blocks required so that ``alloc`` (plus ``cached_prefix``) covers ``num_tokens`` tokens."""
        have = len(alloc.block_table) + len(cached_prefix)
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` would succeed."""
        # Cached prefix blocks that sit in the free list stop being free once taken.
        reclaimed = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return self.blocks_needed(alloc, num_tokens, cached_prefix) <= len(self.free) - reclaimed

    def allocate(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Grow ``alloc`` to cover ``num_tokens`` tokens, first taking the ``cached_prefix`` blocks.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        if not self.can_allocate(alloc, num_tokens, cached_prefix):
            return False
        needed = self.blocks_needed(alloc, num_tokens, cached_prefix)
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            alloc.block_table.append(block_id)
            alloc.block_hashes.append(block.block_hash)  # type: ignore[arg-type]
        for _ in range(needed):
            alloc.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evicting: its cached contents are about to be overwritten.
            self._forget(block)
            self.evictions += 1
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if self.cached.get(block.block_hash) == block.block_id:  # type: ignore[arg-type]
            del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash, block.token_ids = None, ()

    def register_full_blocks(self, alloc: BlockAllocation, token_ids: Sequence[int], num_computed: int) -> None:
        """Make the sequence's full blocks among its first ``num_computed`` tokens reusable.

        The scheduler calls this as soon as it schedules the tokens, before they are computed: a
        request admitted later in the same step may then share the blocks, which is safe because
        every layer stores the whole step's K/V before any attention reads them.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for index in range(len(alloc.block_hashes), num_computed // bs):
            tokens = tuple(token_ids[index * bs:(index + 1) * bs])
            parent = alloc.block_hashes[-1] if alloc.block_hashes else None
            block_hash = chain_hash(parent, tokens)
            alloc.block_hashes.append(block_hash)
            block = self.blocks[alloc.block_table[index]]
            if block_hash not in self.cached and block.block_hash is None:
                self.cached[block_hash] = block.block_id
                block.block_hash, block.token_ids = block_hash, tokens

    def free_blocks(self, alloc: BlockAllocation, num_computed: int | None = None) -> None:
        """Drop the sequence's hold on its blocks; unshared ones return to the free list.

        ``num_computed``: tokens whose K/V really are in the blocks (all by default). A sequence
        preempted before its scheduled tokens ran passes fewer, and full blocks past that point
        lose their hash, so no one reuses contents that were never written.
        """
        first_unwritten = len(alloc.block_table) if num_computed is None else num_computed // self.block_size
        # Last blocks first, so a sequence's tail is evicted before its (more shareable) head.
        for index in range(len(alloc.block_table) - 1, -1, -1):
            block = self.blocks[alloc.block_table[index]]
            block.ref_count -= 1
            if index >= first_unwritten and block.block_hash is not None and block.ref_count == 0:
                self._forget(block)
            if block.ref_count == 0:
                block_id = block.block_id
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)
        alloc.block_table.clear()
        alloc.block_hashes.clear()
