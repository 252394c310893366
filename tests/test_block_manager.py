"""Block allocation, reference counts, prefix hashing with its collision guard, and LRU eviction."""

from __future__ import annotations

import pytest

from minipd.kv import block_manager as bm_module
from minipd.kv.block_manager import BlockAllocation, BlockManager


def computed(bm: BlockManager, tokens: list[int]) -> BlockAllocation:
    """Allocate a sequence for ``tokens`` as the scheduler would, and mark all of them computed."""
    alloc = BlockAllocation()
    cached = bm.find_cached_prefix(tokens)
    assert bm.allocate(alloc, len(tokens), cached)
    bm.register_full_blocks(alloc, tokens, len(tokens))
    return alloc


def test_allocate_counts_blocks_and_fails_cleanly():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = BlockAllocation()
    assert bm.allocate(a, 9)  # 3 blocks
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    b = BlockAllocation()
    assert not bm.allocate(b, 5)  # needs 2, only 1 free: nothing changes
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(a, 16) and bm.num_free_blocks == 0  # grows in place
    bm.free_blocks(a)
    assert bm.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_shared_prefix_is_found_and_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = computed(bm, list(range(10)))  # two full blocks cached, the third partial
    tokens = [*range(8), 99, 98, 97]
    hit = bm.find_cached_prefix(tokens)
    assert hit == first.block_table[:2]
    second = computed(bm, tokens)
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    bm.free_blocks(first)
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [1, 1]
    bm.free_blocks(second)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, list(range(8)))
    # An identical 8-token prompt may reuse only the first block: its last token must be computed.
    assert len(bm.find_cached_prefix(list(range(8)))) == 1
    assert len(bm.find_cached_prefix(list(range(9)))) == 2


def test_chained_hash_depends_on_everything_before():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # Same second block, different first block: no hit at all.
    assert bm.find_cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0]) == []


def test_hash_collisions_are_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, [1, 2, 3, 4, 0])
    assert bm.find_cached_prefix([5, 6, 7, 8, 0]) == []
    assert len(bm.find_cached_prefix([1, 2, 3, 4, 0])) == 1


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = computed(bm, [1, 2, 3])  # block (1,2) cached, (3,) partial
    b = computed(bm, [5, 6, 7])  # block (5,6) cached
    bm.free_blocks(a)
    bm.free_blocks(b)
    assert len(bm.find_cached_prefix([1, 2, 0])) == 1 and len(bm.find_cached_prefix([5, 6, 0])) == 1
    # Two fresh blocks: the partial (unhashed) blocks go first, cached ones survive.
    c = BlockAllocation()
    assert bm.allocate(c, 4)
    assert len(bm.find_cached_prefix([1, 2, 0])) == 1 and len(bm.find_cached_prefix([5, 6, 0])) == 1
    # One more: the least recently freed cached block, (1, 2), is evicted; (5, 6) stays.
    d = BlockAllocation()
    assert bm.allocate(d, 1)
    assert bm.find_cached_prefix([1, 2, 0]) == [] and len(bm.find_cached_prefix([5, 6, 0])) == 1
    assert bm.evictions == 1


def test_reset_prefix_cache_forgets_every_block_only_when_none_is_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    held = computed(bm, tokens)
    first_two = held.block_table[:2]
    assert not bm.reset_prefix_cache()  # a sequence holds its blocks: nothing changes
    assert bm.find_cached_prefix(tokens) == first_two
    bm.free_blocks(held)
    assert bm.find_cached_prefix(tokens) == first_two  # freed, still cached
    queried = bm.stats.queried_tokens
    assert bm.reset_prefix_cache()
    assert bm.find_cached_prefix(tokens) == [] and bm.cached == {}
    assert all(blk.block_hash is None for blk in bm.blocks) and bm.num_free_blocks == 8
    assert bm.stats.queried_tokens == queried  # counters keep counting across a reset
    again = computed(bm, tokens)  # and the cache fills again
    refilled = again.block_table[:2]
    bm.free_blocks(again)
    assert bm.find_cached_prefix(tokens) == refilled


def test_prefix_caching_off_finds_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    computed(bm, [1, 2, 3])
    assert bm.find_cached_prefix([1, 2, 3]) == []


def test_invalid_sizes():
    with pytest.raises(ValueError, match="block"):
        BlockManager(num_blocks=0, block_size=16)


def test_a_second_copy_of_a_prefix_does_not_hide_the_rest_of_the_first():
    # Two sequences computed the same tokens into their own blocks (prefill-first with chunked prefill can
    # do this): A committed its first three blocks, then B all five, then A the rest. A lookup walks the
    # chain from the first block, so only A's blocks can be found: B's later blocks must not be registered
    # in A's place, or the prefix would be cut at the fourth block for every later request.
    bm = BlockManager(num_blocks=12, block_size=2)
    tokens = list(range(1, 11))
    a, b = BlockAllocation(), BlockAllocation()
    assert bm.allocate(a, 10) and bm.allocate(b, 10)
    bm.register_full_blocks(a, tokens, 6)
    bm.register_full_blocks(b, tokens, 10)
    bm.register_full_blocks(a, tokens, 10)
    assert bm.find_cached_prefix([*tokens, 0]) == a.block_table


def test_only_full_blocks_can_be_dropped():
    bm = BlockManager(num_blocks=4, block_size=4)
    alloc = BlockAllocation()
    assert bm.allocate(alloc, 10)  # two full blocks and one with two tokens
    with pytest.raises(ValueError, match="full blocks"):
        bm.drop_blocks(alloc, [2], 10)
    bm.drop_blocks(alloc, [0], 10)
    assert alloc.num_dropped_tokens == 4 and len(alloc.block_table) == 2
