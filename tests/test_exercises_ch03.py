"""Chapter 03 checkers against planted bugs (the three states of every checker: test_exercise_states.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from minipd.config import ModelConfig
from minipd.exercises import ch03
from minipd.exercises.checking import CheckResult
from minipd.kv.block_manager import BlockAllocation, BlockManager, chain_hash


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch03, f"check_{name}")


def stub(*args: Any) -> Any:
    raise NotImplementedError


# --- the three states, for every checker --------------------------------------------------------


# --- planted bugs --------------------------------------------------------------------------------


def bytes_with_query_heads(config: ModelConfig, bytes_per_element: int) -> int:
    """Counts a K/V head per query head: right only without grouped-query attention."""
    return 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * bytes_per_element


def bytes_without_v(config: ModelConfig, bytes_per_element: int) -> int:
    """Forgets that V is cached as well as K."""
    return config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_element


def bytes_with_derived_head_dim(config: ModelConfig, bytes_per_element: int) -> int:
    """Derives head_dim from the hidden size, which Qwen3 does not follow."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * bytes_per_element


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


def prefix_unchained(token_ids: Sequence[int], cached: dict[int, int], block_size: int) -> list[int]:
    """Hashes each block on its own, so only the first block can ever match the chained table."""
    found = []
    for index in range((len(token_ids) - 1) // block_size):
        h = chain_hash(None, token_ids[index * block_size:(index + 1) * block_size])
        if h not in cached:
            break
        found.append(cached[h])
    return found


def prefix_covering_last_token(token_ids: Sequence[int], cached: dict[int, int], block_size: int) -> list[int]:
    """Also takes a final full block, leaving nothing to compute."""
    found, parent = [], None
    for index in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[index * block_size:(index + 1) * block_size])
        if parent not in cached:
            break
        found.append(cached[parent])
    return found


def prefix_skipping_misses(token_ids: Sequence[int], cached: dict[int, int], block_size: int) -> list[int]:
    """Keeps going after a miss, so a block behind an evicted one is returned out of place."""
    found, parent = [], None
    for index in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, token_ids[index * block_size:(index + 1) * block_size])
        if parent in cached:
            found.append(cached[parent])
    return found


@pytest.mark.parametrize(("name", "bug"), [
    ("kv_bytes_per_token", bytes_with_query_heads),
    ("kv_bytes_per_token", bytes_without_v),
    ("kv_bytes_per_token", bytes_with_derived_head_dim),
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
    result = ch03.check_kv_bytes_per_token(bytes_with_query_heads)
    assert "got 524288, expected 131072 (diff 393216)" in result.message
    assert result.max_diff == 393216
    assert capsys.readouterr().out.startswith("FAIL kv_bytes_per_token: got 524288")

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


def test_reference_bytes_match_model_config() -> None:
    for case in ch03._kv_bytes_cases():
        config, nbytes = case.args
        assert ch03.reference_kv_bytes_per_token(config, nbytes) == config.kv_bytes_per_token(nbytes)
