"""Chapter 03 checkers against planted bugs (the three states of every checker: test_exercise_states.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from minipd.exercises import ch01, ch03
from minipd.exercises.checking import CheckResult
from minipd.kv.block_manager import BlockAllocation, BlockManager, chain_hash


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch03, f"check_{name}")


def stub(*args: Any) -> Any:
    raise NotImplementedError


# --- planted bugs --------------------------------------------------------------------------------


def blocks_floor(num_tokens: int, block_size: int) -> int:
    return num_tokens // block_size


def blocks_plus_one(num_tokens: int, block_size: int) -> int:
    """Right unless the tokens fill their last block exactly."""
    return num_tokens // block_size + 1


def slots_ignoring_table(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Treats the pool as one contiguous buffer."""
    return positions.long()


def slots_without_block_offset(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Adds the block id instead of the block's first slot."""
    return block_table.long()[positions // block_size] + positions % block_size


def slots_int32(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Right values in the table's dtype instead of int64."""
    return block_table[positions // block_size] * block_size + (positions % block_size).to(block_table.dtype)


def prefix_unchained(token_ids: Sequence[int], cached: dict[bytes, int], block_size: int) -> list[int]:
    """Hashes each block on its own, so only the first block can ever match the chained table."""
    found = []
    for index in range((len(token_ids) - 1) // block_size):
        h = chain_hash(None, token_ids[index * block_size:(index + 1) * block_size])
        if h not in cached:
            break
        found.append(cached[h])
    return found


def prefix_covering_last_token(token_ids: Sequence[int], cached: dict[bytes, int], block_size: int) -> list[int]:
    """Also takes a final full block, leaving nothing to compute."""
    found, parent = [], None
    for index in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[index * block_size:(index + 1) * block_size])
        if parent not in cached:
            break
        found.append(cached[parent])
    return found


def prefix_skipping_misses(token_ids: Sequence[int], cached: dict[bytes, int], block_size: int) -> list[int]:
    """Keeps going after a miss, so a block behind an evicted one is returned out of place."""
    found, parent = [], None
    for index in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, token_ids[index * block_size:(index + 1) * block_size])
        if parent in cached:
            found.append(cached[parent])
    return found


@pytest.mark.parametrize(("name", "bug"), [
    ("blocks_needed", blocks_floor),
    ("blocks_needed", blocks_plus_one),
    ("slot_mapping", slots_ignoring_table),
    ("slot_mapping", slots_without_block_offset),
    ("slot_mapping", slots_int32),
    ("longest_cached_prefix", prefix_unchained),
    ("longest_cached_prefix", prefix_covering_last_token),
    ("longest_cached_prefix", prefix_skipping_misses),
])
def test_planted_bug_fails(name: str, bug: Callable[..., Any]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL", result
    assert "case:" in result.message


def test_fail_messages_say_where_and_by_how_much(capsys: pytest.CaptureFixture[str]) -> None:
    result = ch03.check_blocks_needed(blocks_plus_one)
    assert "got 1, expected 0 (diff 1) [case: 0 tokens]" in result.message and result.max_diff == 1
    assert capsys.readouterr().out.startswith("FAIL blocks_needed: got 1")

    result = ch03.check_slot_mapping(slots_without_block_offset)
    assert "max |diff|" in result.message and result.first_mismatch == (0,)

    result = ch03.check_longest_cached_prefix(prefix_unchained)
    assert "first mismatch at position 1" in result.message and result.first_mismatch == 1


def test_integer_like_answers_are_accepted() -> None:
    assert ch03.check_blocks_needed(lambda n, bs: torch.tensor(-(-n // bs))).passed
    assert ch03.check_longest_cached_prefix(lambda *a: tuple(ch03.reference_longest_cached_prefix(*a))).passed
    assert ch03.check_blocks_needed(lambda n, bs: float(-(-n // bs))).status == "FAIL"


# --- the references agree with the engine --------------------------------------------------------


def test_reference_prefix_lookup_matches_the_block_manager() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 50, (30,), generator=gen).tolist()
    for tokens in (base, [*base[:13], 1, 2, 3, 4, 5], base[:4] + [9] * 9):
        alloc = BlockAllocation()
        assert bm.allocate(alloc, len(tokens), bm.find_cached_prefix(tokens))
        bm.register_full_blocks(alloc, tokens, len(tokens))
    for n in range(1, 35):
        for query in (base[:n], [*base[:n], 7], base[:13] + [1, 2, 3, 4, 5, 6][:n % 7]):
            assert ch03.reference_longest_cached_prefix(query, bm.cached, 4) == bm.find_cached_prefix(query)


def test_reference_slot_mapping_matches_the_model_runner_arithmetic() -> None:
    table = [5, 2, 9]
    bs = 4
    positions = torch.arange(12)
    expected = [table[p // bs] * bs + p % bs for p in range(12)]  # as ModelRunner.prepare computes it
    assert ch03.reference_slot_mapping(torch.tensor(table, dtype=torch.int32), positions, bs).tolist() == expected




# --- the engine stage ----------------------------------------------------------------------------


def slots_off_by_one_block_in_decode(block_table: torch.Tensor, positions: torch.Tensor, block_size: int
                                     ) -> torch.Tensor:
    """Right for prefill chunks, but a decode token goes one block further (only the engine has 3 requests
    decoding with interleaved tables, so only the engine stage sees it go wrong)."""
    slots = ch03.reference_slot_mapping(block_table, positions, block_size)
    return slots + block_size if len(positions) == 1 and int(positions[0]) > 30 else slots


def test_engine_stage_of_slots_names_the_first_wrong_slot() -> None:
    assert ch03.check_slot_mapping(slots_off_by_one_block_in_decode).passed is False
    result = ch03._check_slots_in_engine("slot_mapping", slots_off_by_one_block_in_decode)
    assert result.status == "FAIL" and "first wrong slot at step" in result.message
    assert "position 31" in result.message and result.max_diff == ch03.ENGINE_BLOCK_SIZE
    result = ch03._check_slots_in_engine("slot_mapping", slots_ignoring_table)
    assert result.status == "FAIL" and "the engine's" in result.message


def test_engine_stage_of_slots_checks_what_it_is_given() -> None:
    result = ch03._check_slots_in_engine("slot_mapping", lambda t, p, bs: p.float())
    assert result.status == "FAIL" and "expected an integer tensor" in result.message
    result = ch03._check_slots_in_engine("slot_mapping", lambda t, p, bs: p * 10_000)
    assert result.status == "FAIL" and "raised" in result.message


def test_reader_slot_mapping_puts_the_runner_back_even_when_the_reader_raises() -> None:
    llm = ch01.engine_llm(block_size=4)
    expected = ch01.greedy_tokens(llm)
    with pytest.raises(ZeroDivisionError), ch03.reader_slot_mapping(llm, lambda *a: 1 / 0, {}):
        ch01.greedy_tokens(llm)
    assert "prepare" not in vars(llm.engine.core.runner)
    assert ch01.greedy_tokens(ch01.engine_llm(block_size=4)) == expected


def test_engine_stage_of_prefix_lookup() -> None:
    result = ch03._check_prefix_in_engine("longest_cached_prefix", prefix_covering_last_token)
    assert result.status == "FAIL" and "at least its last token must be left to compute" in result.message
    result = ch03._check_prefix_in_engine("longest_cached_prefix", lambda tokens, cached, bs: [])
    assert result.status == "FAIL" and "round 2, request 0" in result.message and "reused 0 cached tokens" in \
        result.message
    result = ch03._check_prefix_in_engine("longest_cached_prefix",
                                          lambda tokens, cached, bs: [max(cached.values(), default=0) + 1])
    assert result.status == "FAIL" and "holds no cached block" in result.message


def test_prefix_workload_reuses_blocks_and_keeps_the_last_token() -> None:
    outs = ch03._prefix_rounds(ch01.engine_llm(block_size=4, enable_prefix_caching=True, num_kv_blocks=128))
    cached = [o.metrics.cached_tokens for o in outs[1]]
    assert cached[0] > 0 and all(c > 0 for c in cached)
    assert cached[3] == 3 * ch03.ENGINE_BLOCK_SIZE  # four cached blocks, the last one recomputed


def test_reader_prefix_lookup_puts_the_block_manager_back() -> None:
    llm = ch01.engine_llm(block_size=4, enable_prefix_caching=True)
    with pytest.raises(ZeroDivisionError), ch03.reader_prefix_lookup(llm, lambda *a: 1 / 0):
        ch01.greedy_tokens(llm)
    assert "find_cached_prefix" not in vars(llm.engine.block_manager)


# --- eviction ------------------------------------------------------------------------------------


def pick_most_recent(free: list[ch03.FreeBlock]) -> int:
    """Plain blocks first, but then the most recently freed cached block (MRU): throws away the hot prefix."""
    plain = [b for b in free if not b.cached]
    return plain[0].block_id if plain else max(free, key=lambda b: b.freed_at).block_id


def pick_cached_first(free: list[ch03.FreeBlock]) -> int:
    """Evicts a cached block even while plain ones are free."""
    cached = [b for b in free if b.cached]
    return min(cached, key=lambda b: b.freed_at).block_id if cached else free[0].block_id


def pick_oldest_whatever(free: list[ch03.FreeBlock]) -> int:
    """LRU over every free block, ignoring whether it holds anything worth keeping."""
    return min(free, key=lambda b: b.freed_at).block_id


def pick_lowest_id(free: list[ch03.FreeBlock]) -> int:
    return free[0].block_id


@pytest.mark.parametrize("bug", [pick_most_recent, pick_cached_first, pick_oldest_whatever, pick_lowest_id])
def test_planted_eviction_bug_fails(bug: Callable[..., Any]) -> None:
    result = ch03.check_pick_block(bug)
    assert result.status == "FAIL" and "case:" in result.message


@pytest.mark.parametrize(("bug", "expected"), [
    (pick_most_recent, "after phase 3, 9 cached blocks were evicted; with the engine's own choice, 5"),
    (pick_cached_first, "after phase 2, 9 cached blocks were evicted; with the engine's own choice, 2"),
])
def test_engine_stage_of_eviction_counts_evictions(bug: Callable[..., Any], expected: str) -> None:
    result = ch03._check_eviction_in_engine("pick_block", bug)
    assert result.status == "FAIL" and expected in result.message and result.max_diff in (4, 7)


def test_engine_stage_of_eviction_checks_the_answer_and_restores_the_manager() -> None:
    result = ch03._check_eviction_in_engine("pick_block", lambda free: -1)
    assert result.status == "FAIL" and "not the id of a free block" in result.message
    llm = ch01.engine_llm(**ch03.EVICTION_POOL)
    with pytest.raises(ZeroDivisionError), ch03.reader_eviction(llm, lambda free: 1 / 0):
        ch01.greedy_tokens(llm)
    assert not {"_take_free_block", "_release"} & set(vars(llm.engine.block_manager))


def test_reference_pick_is_the_block_managers_order() -> None:
    """The block manager takes the first block of its free list; the reference must pick a block that is
    exactly as good: the same one when all are cached, a plain one when there is one."""
    llm = ch01.engine_llm(**ch03.EVICTION_POOL)
    bm = llm.engine.block_manager
    evicting: list[bool] = []

    def spy(free: list[ch03.FreeBlock]) -> int:
        first = next(iter(bm.free))
        pick = ch03.reference_pick_block(free)
        evicting.append(bm.blocks[first].block_hash is not None)
        assert pick == first if evicting[-1] else bm.blocks[pick].block_hash is None
        return first

    with ch03.reader_eviction(llm, spy):
        ch03._eviction_phases(llm)
    assert sum(evicting) == bm.evictions == 5 and len(evicting) > 24
