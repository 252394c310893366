"""Chapter 03b checkers against planted bugs (the three states of every checker: test_exercise_states.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from minipd.exercises import ch03b
from minipd.exercises.checking import CheckResult


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch03b, f"check_{name}")


def stub(*args: Any) -> Any:
    raise NotImplementedError


# --- planted bugs --------------------------------------------------------------------------------


def gather_ignoring_the_table(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Reads blocks 0, 1, 2, ... as if the pool were contiguous."""
    return cache.flatten(0, 1)[:length]


def gather_whole_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Right blocks, but keeps the unused tail of the last one."""
    blocks = -(-length // cache.shape[1])
    return cache[block_table[:blocks].long()].flatten(0, 1)


def merge_without_rescaling(m1: torch.Tensor, l1: torch.Tensor, acc1: torch.Tensor, m2: torch.Tensor,
                            l2: torch.Tensor, acc2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adds the sums as if both parts shared one max."""
    return torch.maximum(m1, m2), l1 + l2, acc1 + acc2


def merge_with_exp_of_raw_max(m1: torch.Tensor, l1: torch.Tensor, acc1: torch.Tensor, m2: torch.Tensor,
                              l2: torch.Tensor, acc2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right on small scores, but un-shifts by exp(m) directly, which overflows for large ones."""
    m = torch.maximum(m1, m2)
    s1, s2 = torch.exp(m1) / torch.exp(m), torch.exp(m2) / torch.exp(m)
    return m, l1 * s1 + l2 * s2, acc1 * s1[:, None] + acc2 * s2[:, None]


def merge_through_the_first_max(m1: torch.Tensor, l1: torch.Tensor, acc1: torch.Tensor, m2: torch.Tensor,
                                l2: torch.Tensor, acc2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Exact for any two non-empty parts, but goes through exp(m2 - m1), which is inf when the first
    part is empty (m1 = -inf): inf * 0 is NaN."""
    m = torch.maximum(m1, m2)
    s1, s2 = torch.exp(m1 - m), torch.exp(m2 - m1) * torch.exp(m1 - m)
    return m, l1 * s1 + l2 * s2, acc1 * s1[:, None] + acc2 * s2[:, None]


def decode_over_whole_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """Forgets that the last block may be only partly filled."""
    bs = k_cache.shape[1]
    padded = -(-length // bs) * bs
    return ch03b.reference_paged_decode_one_sequence(q, k_cache, v_cache, block_table, padded, scale)


def decode_with_one_kv_head(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """Pairs every query head with KV head 0."""
    k1, v1 = k_cache[:, :, :1], v_cache[:, :, :1]
    return ch03b.reference_paged_decode_one_sequence(q, k1, v1, block_table, length, scale)


@pytest.mark.parametrize(("name", "bug"), [
    ("paged_gather", gather_ignoring_the_table),
    ("paged_gather", gather_whole_blocks),
    ("online_softmax_merge", merge_without_rescaling),
    ("online_softmax_merge", merge_with_exp_of_raw_max),
    ("online_softmax_merge", merge_through_the_first_max),
    ("paged_decode_one_sequence", decode_over_whole_blocks),
    ("paged_decode_one_sequence", decode_with_one_kv_head),
])
def test_planted_bug_fails(name: str, bug: Callable[..., Any]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL", result
    assert "case:" in result.message


def test_merge_explains_a_wrong_return_type() -> None:
    result = ch03b.check_online_softmax_merge(lambda *a: a[0])
    assert result.status == "FAIL" and "tuple (m, l, acc)" in result.message


def test_a_merge_that_breaks_on_an_empty_part_is_caught_and_the_component_named() -> None:
    result = ch03b.check_online_softmax_merge(merge_through_the_first_max)
    assert result.status == "FAIL"
    assert "first part empty" in result.message and "that is l of row 0" in result.message
    acc_only = ch03b.check_online_softmax_merge(
        lambda m1, l1, a1, m2, l2, a2: (*ch03b.reference_online_softmax_merge(m1, l1, a1, m2, l2, a2)[:2],
                                        ch03b.reference_online_softmax_merge(m1, l1, a1, m2, l2, a2)[2] * 1.01))
    assert acc_only.status == "FAIL" and "that is acc (column" in acc_only.message
