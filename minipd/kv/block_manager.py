"""Hands out fixed-size KV blocks, counts references, and remembers full blocks for prefix reuse.

A sequence's KV cache is a list of block ids, its *block table*. Blocks are shared between
sequences only through prefix caching: a full block is identified by a chained hash of its tokens
and of the block before it, so two sequences that start with the same tokens find the same blocks.
When a block's last user lets go it goes back to the free list but keeps its contents and hash, so
a later request can still hit it; it is really reused (evicted) only when a fresh block is needed,
least recently freed first.

A block is registered for reuse only once its K/V are *committed* — computed by a step that
finished, or imported from another worker — never when it is merely scheduled: a step that fails,
or KV that has not arrived yet, must never be read by another request. The hash is SHA-256 (as
vLLM uses since CVE-2025-25183), and on top of it a hit must match the block's tokens and the
identity of its parent block, so even a forced hash collision cannot hand one request another's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

#: A block's identity while it holds given contents: (block id, how many times it was filled).
BlockIdentity = tuple[int, int]


@dataclass(eq=False)
class Block:
    """One block of the pool: who uses it and, once full and committed, what it holds."""

    block_id: int
    ref_count: int = 0
    #: Chained hash of the tokens it holds, set once it is full, committed and registered for reuse.
    block_hash: bytes | None = None
    #: The tokens it holds, compared on every hit to rule out hash collisions.
    token_ids: tuple[int, ...] = ()
    #: Identity of the block before it in its sequence (None for a first block), checked on every hit.
    parent: BlockIdentity | None = None
    #: Bumped each time the block is handed out afresh, so an old identity never matches new contents.
    generation: int = 0

    @property
    def identity(self) -> BlockIdentity:
        """``(block_id, generation)``: names these contents, not just this slot of memory."""
        return self.block_id, self.generation


#: Parent of a sequence's first block: a fixed value, so hashes are equal in every process, which
#: moving blocks between workers relies on.
ROOT_HASH = b"minipd-root"


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Identity of a full block: SHA-256 of its parent's hash and its tokens (as 64-bit integers)."""
    digest = hashlib.sha256(ROOT_HASH if parent is None else parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``; extends ``known`` (the leading ones) in place."""
    hashes = [] if known is None else known
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(chain_hash(parent, token_ids[index * block_size:(index + 1) * block_size]))
    return hashes


def _first_hashes(token_ids: Sequence[int], block_size: int, count: int,
                  hashes: Sequence[bytes] | None) -> Sequence[bytes]:
    """At least the first ``count`` block hashes of ``token_ids``: ``hashes`` itself when long enough, else
    computed (extending ``hashes`` in place when it is a list, so a sequence hashes each block once)."""
    if hashes is not None and len(hashes) >= count:
        return hashes
    return block_hashes(token_ids[:count * block_size], block_size, hashes if isinstance(hashes, list) else None)


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
    #: Hashes of the sequence's leading full blocks whose K/V are committed (whether or not this
    #: sequence's copy is the one registered for reuse).
    committed_hashes: list[bytes] = field(default_factory=list)
    #: Tokens whose blocks were dropped from the middle of the table (token eviction). Token
    #: ``i``'s K/V then sit at cache index ``i - num_dropped_tokens`` rather than at its position.
    num_dropped_tokens: int = 0
    #: The first token position of every dropped block, in order.
    dropped_positions: list[int] = field(default_factory=list)
    #: With adaptive KV precision: whether its blocks are compressed (None until it has blocks).
    compressed: bool | None = None
    #: After token-level eviction: the position of each of the leading cache slots (later slots hold the
    #: tokens computed since, at position ``slot + num_dropped_tokens``). None: block-level only.
    token_positions: list[int] | None = None

    def block_positions(self, block_size: int) -> list[int]:
        """The first token position of each block in the table (dropped blocks leave gaps)."""
        if self.token_positions is not None:
            return [self.cache_position(i * block_size) for i in range(len(self.block_table))]
        dropped, positions, start = set(self.dropped_positions), [], 0
        while len(positions) < len(self.block_table):
            if start not in dropped:
                positions.append(start)
            start += block_size
        return positions

    def cache_position(self, slot: int, block_size: int | None = None) -> int:
        """The token position held by cache slot ``slot`` (``block_size`` needed after block drops)."""
        if self.token_positions is not None:
            kept = self.token_positions
            return kept[slot] if slot < len(kept) else slot + self.num_dropped_tokens
        if not self.dropped_positions:
            return slot
        assert block_size is not None, "block_size is needed to place slots after block drops"
        return self.block_positions(block_size)[slot // block_size] + slot % block_size

    def cache_positions(self, block_size: int, count: int) -> list[int]:
        """The token position of each of the first ``count`` cache slots."""
        if self.token_positions is None and self.dropped_positions:
            return [p + i for p in self.block_positions(block_size) for i in range(block_size)][:count]
        return [self.cache_position(i) for i in range(count)]


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
        self.cached: dict[bytes, int] = {}  # block hash -> block id
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

    # ------------------------------------------------------------------------------- lookup
    def find_cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> list[int]:
        """Block ids holding the longest committed prefix of ``token_ids`` (whole blocks only).

        At least one token is always left to compute, since the last position's logits are needed
        to sample the next token. ``hashes`` may pass the sequence's block hashes already computed (a
        list is extended in place).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        usable = (len(token_ids) - 1) // bs
        hashes = _first_hashes(token_ids, bs, usable, hashes)
        found: list[int] = []
        parent: BlockIdentity | None = None
        for index in range(usable):
            block_id = self.cached.get(hashes[index])
            if block_id is None:
                break
            block = self.blocks[block_id]
            # The whole chain must match, not just the hash: this block's tokens and its parent.
            if block.parent != parent or block.token_ids != tuple(token_ids[index * bs:(index + 1) * bs]):
                break
            found.append(block_id)
            parent = block.identity
        return found

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one prompt's prefix-cache lookup in the hit-rate statistics."""
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so that no later prompt hits what earlier ones left (e.g. between
        timed repetitions of the same prompts).

        Only possible while no sequence holds a block (a held block's contents are still in use and may be
        shared): returns False, changing nothing, otherwise; True once the cache is empty. The blocks stay
        free; the lookup statistics keep counting.
        """
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None:
                self._forget(block)
        return True

    # --------------------------------------------------------------------------- allocation
    def blocks_needed(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> int:
        """Fresh blocks required so that ``alloc`` (plus ``cached_prefix``) covers ``num_tokens`` tokens."""
        have = len(alloc.block_table) + len(cached_prefix)
        return max(0, -(-(num_tokens - alloc.num_dropped_tokens) // self.block_size) - have)

    def can_allocate(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` would succeed."""
        # Cached prefix blocks that sit in the free list stop being free once taken.
        reclaimed = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return self.blocks_needed(alloc, num_tokens, cached_prefix) <= len(self.free) - reclaimed

    def allocate(self, alloc: BlockAllocation, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Grow ``alloc`` to cover ``num_tokens`` tokens, first taking the ``cached_prefix`` blocks.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        if not cached_prefix:
            # The common case (every decode step of every request): blocks_needed's count, inline, as it runs
            # per row of every step (calling it cost the simulator ~5%).
            needed = -(-(num_tokens - alloc.num_dropped_tokens) // self.block_size) - len(alloc.block_table)
            if needed <= 0:
                return True
            if needed > len(self.free):
                return False
            table = alloc.block_table
            for _ in range(needed):
                table.append(self._take_free_block())
            return True
        if not self.can_allocate(alloc, num_tokens, cached_prefix):
            return False
        needed = self.blocks_needed(alloc, num_tokens, cached_prefix)
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            alloc.block_table.append(block_id)
            alloc.committed_hashes.append(block.block_hash)  # type: ignore[arg-type]
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
        block.generation += 1
        return block_id

    def _forget(self, block: Block) -> None:
        if self.cached.get(block.block_hash) == block.block_id:  # type: ignore[arg-type]
            del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash, block.token_ids, block.parent = None, (), None

    def pin(self, block_ids: Sequence[int]) -> BlockAllocation:
        """Take one more reference on ``block_ids`` (e.g. while another worker reads them).

        Returns an allocation over them; :meth:`free_blocks` on it lets go. Pinned blocks are never
        evicted or handed out, whatever happens to the sequence that filled them.
        """
        pinned = BlockAllocation()
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} is free: only blocks a sequence holds can be pinned")
            block.ref_count += 1
            pinned.block_table.append(block_id)
        return pinned

    # ------------------------------------------------------------------------------- commit
    def register_full_blocks(self, alloc: BlockAllocation, token_ids: Sequence[int], num_computed: int,
                             hashes: Sequence[bytes] | None = None) -> None:
        """Commit the sequence's full blocks among its first ``num_computed`` tokens: make them reusable.

        Call it only once their K/V are really in the pool (after the step that computed them
        finished, or after an import). ``hashes`` may pass the sequence's block hashes already computed.
        """
        if not self.enable_prefix_caching or alloc.num_dropped_tokens:
            return  # after token eviction, table indices no longer match token positions
        bs = self.block_size
        end = num_computed // bs
        hashes = _first_hashes(token_ids, bs, end, hashes)
        for index in range(len(alloc.committed_hashes), end):
            block_hash = hashes[index]
            alloc.committed_hashes.append(block_hash)
            block = self.blocks[alloc.block_table[index]]
            parent = self.blocks[alloc.block_table[index - 1]] if index else None
            # Only a chain of registered blocks can be found (a lookup walks it from the first block): if
            # this sequence computed its own copy of an earlier block, its later blocks stay unregistered.
            reachable = parent is None or (parent.block_hash is not None
                                           and self.cached.get(parent.block_hash) == parent.block_id)
            if reachable and block_hash not in self.cached and block.block_hash is None:
                self.cached[block_hash] = block.block_id
                block.block_hash, block.token_ids = block_hash, tuple(token_ids[index * bs:(index + 1) * bs])
                block.parent = None if parent is None else parent.identity

    # --------------------------------------------------------------------------------- free
    def free_blocks(self, alloc: BlockAllocation) -> None:
        """Drop the sequence's hold on its blocks; unshared ones return to the free list.

        Blocks keep their registered contents (they were committed), so a later request can still hit them.
        """
        # Last blocks first, so a sequence's tail is evicted before its (more shareable) head.
        for index in range(len(alloc.block_table) - 1, -1, -1):
            self._release(alloc.block_table[index])
        alloc.block_table.clear()
        alloc.committed_hashes.clear()
        alloc.num_dropped_tokens = 0
        alloc.dropped_positions.clear()
        alloc.token_positions = None

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.block_hash is None:
                self.free.move_to_end(block_id, last=False)

    def drop_blocks(self, alloc: BlockAllocation, indices: Sequence[int], num_computed: int) -> None:
        """Remove the full blocks at table ``indices`` from a sequence with ``num_computed`` tokens of K/V.

        For token eviction: the sequence keeps its positions (RoPE still sees the true ones) but its
        later tokens' K/V move up in the cache; it stops registering blocks for prefix reuse from
        then on. Only full blocks may go: the partly filled last one is where the next token is written.
        """
        drop = sorted(set(indices))
        full = (num_computed - alloc.num_dropped_tokens) // self.block_size
        if drop and (drop[0] < 0 or drop[-1] >= full):
            raise ValueError(f"block indices must be in [0, {full}) (the full blocks), got {list(indices)}")
        positions = alloc.block_positions(self.block_size)
        alloc.dropped_positions = sorted([*alloc.dropped_positions, *(positions[i] for i in drop)])
        for index in reversed(drop):
            self._release(alloc.block_table.pop(index))
        alloc.num_dropped_tokens += len(drop) * self.block_size
        del alloc.committed_hashes[min(drop, default=len(alloc.committed_hashes)):]

    def compact(self, alloc: BlockAllocation, keep: Sequence[int], num_cached: int) -> list[tuple[int, int]] | None:
        """Keep only the cache slots ``keep`` (ascending) of ``num_cached``, packed to the front of the table.

        For token-level eviction: slot ``keep[j]`` moves to slot ``j``; the blocks past the kept tokens go
        back to the pool, whole. A block that will be written and is shared (another holder, or
        registered in the prefix cache) is replaced by a private one first, so no other reader sees a
        byte change. Returns ``(from slot, to slot)`` pool slots for every token that moves, for the
        caller to copy (reading all of them before writing any), or None, changing nothing, when there
        is no free block for such a copy.
        """
        bs, table = self.block_size, alloc.block_table
        if list(keep) != sorted(set(keep)) or (keep and (keep[0] < 0 or keep[-1] >= num_cached)):
            raise ValueError(f"keep must be ascending slots in [0, {num_cached})")
        first_moved = next((j for j, slot in enumerate(keep) if slot != j), len(keep))
        needed = -(-len(keep) // bs)
        shared = sum(1 for b in table[first_moved // bs:needed]
                     if self.blocks[b].ref_count > 1 or self.blocks[b].block_hash is not None)
        freed = sum(1 for b in table[needed:] if self.blocks[b].ref_count == 1)
        if shared > len(self.free) + freed:
            return None
        positions = alloc.cache_positions(bs, num_cached)
        old_table = list(table)
        for index in range(needed, len(table)):  # whole blocks past the kept tokens
            self._release(table[index])
        del table[needed:]
        for index in range(first_moved // bs, needed):  # blocks that will be written: private ones only
            block = self.blocks[table[index]]
            if block.ref_count > 1 or block.block_hash is not None:
                self._release(table[index])
                table[index] = self._take_free_block()
        moves = []
        for j in range(first_moved // bs * bs, len(keep)):  # a replaced block needs its unmoved slots too
            moves.append((old_table[keep[j] // bs] * bs + keep[j] % bs, table[j // bs] * bs + j % bs))
        alloc.token_positions = [positions[slot] for slot in keep]
        alloc.num_dropped_tokens += num_cached - len(keep)
        alloc.committed_hashes.clear()
        return moves
