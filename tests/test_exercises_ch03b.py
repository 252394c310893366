"""Chapter 03b checkers against planted bugs (the three states of every checker: test_exercise_states.py),
and the engine stage that runs the reader's kernel inside tiny-py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from minipd.exercises import ch01, ch03b
from minipd.exercises.checking import CheckResult
from minipd.kernels.backend import TORCH_BACKEND
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch03b, f"check_{name}")


# --- planted bugs --------------------------------------------------------------------------------


def prefill_mask_from_chunk_start(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Places a chunk's queries at the first positions: right for whole prompts, wrong for later chunks."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i in range(len(context_lens)):
        start, end, context = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        k = ch03b._read_kv(k_cache, block_tables[i], torch.arange(context)).repeat_interleave(group, dim=1)
        v = ch03b._read_kv(v_cache, block_tables[i], torch.arange(context)).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[start:end], k) * scale
        mask = torch.arange(context)[None, :] > torch.arange(end - start)[:, None]  # query t at position t
        out[start:end] = torch.einsum("hts,shd->thd", scores.masked_fill(mask, float("-inf")).softmax(-1), v)
    return out


def prefill_first_table_only(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Reads every sequence through the first sequence's block table."""
    tables = block_tables[:1].expand_as(block_tables)
    return ch03b.reference_paged_prefill_attention(q, k_cache, v_cache, tables, query_start_loc, context_lens, scale)


def prefill_unscaled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return ch03b.reference_paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                   context_lens, 1.0)


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


def split_k_with(merge: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """The reference split-K decode with another merge."""
    def split_k(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, scale: float, split_size: int) -> torch.Tensor:
        original = ch03b.reference_online_softmax_merge
        ch03b.reference_online_softmax_merge = merge  # type: ignore[assignment]
        try:
            return ch03b.reference_split_k_decode(q, k_cache, v_cache, block_tables, context_lens, scale, split_size)
        finally:
            ch03b.reference_online_softmax_merge = original  # type: ignore[assignment]
    split_k.__name__ = f"split_k_with_{merge.__name__}"
    return split_k


def split_k_averaging_outputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              split_size: int) -> torch.Tensor:
    """Normalises each split on its own and averages the splits' outputs (ignores how much each one weighs)."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(context_lens[i])
        parts = [ch03b.reference_split_k_decode(q[i:i + 1], k_cache, v_cache, block_tables[i:i + 1],
                                                torch.tensor([min(n, s + split_size)]), scale, split_size)
                 for s in range(0, n, split_size)]
        out[i] = torch.stack(parts).mean(0)[0]
    return out


def split_k_dropping_the_tail(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              split_size: int) -> torch.Tensor:
    """Only whole splits: the last, shorter one is forgotten (the newest tokens, the token itself included)."""
    lens = torch.where(context_lens >= split_size, context_lens - context_lens % split_size, context_lens)
    return ch03b.reference_split_k_decode(q, k_cache, v_cache, block_tables, lens, scale, split_size)


@pytest.mark.parametrize(("name", "bug"), [
    ("paged_prefill_attention", prefill_mask_from_chunk_start),
    ("paged_prefill_attention", prefill_first_table_only),
    ("paged_prefill_attention", prefill_unscaled),
    ("online_softmax_merge", merge_without_rescaling),
    ("online_softmax_merge", merge_with_exp_of_raw_max),
    ("online_softmax_merge", merge_through_the_first_max),
    ("split_k_decode", split_k_with(merge_without_rescaling)),
    ("split_k_decode", split_k_averaging_outputs),
    ("split_k_decode", split_k_dropping_the_tail),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_planted_bug_fails(name: str, bug: Callable[..., Any]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL", result
    assert "case:" in result.message


# --- the engine stage ----------------------------------------------------------------------------


def test_the_engine_calls_the_reader_kernel_every_layer_and_compares_each_call() -> None:
    calls = []

    def decode(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return ch03b.reference_split_k_decode(*args)

    assert ch03b.check_split_k_decode(decode).passed
    engine_calls = calls[len(calls) - (ch01.ENGINE_TOKENS - 1) * 6:]
    assert len(calls) > (ch01.ENGINE_TOKENS - 1) * 6 and set(engine_calls) <= {1, 2, 3}


def test_engine_stage_reports_the_first_differing_call() -> None:
    def wrong_when_batched(q: torch.Tensor, *args: Any) -> torch.Tensor:
        out = ch03b.reference_split_k_decode(q, *args)
        return out * 1.5 if q.shape[0] == 3 else out  # the unit cases never have 3 sequences

    assert ch03b.check_split_k_decode(wrong_when_batched).status == "FAIL"
    recorder = ch03b.KernelRecorder(lambda q, *a, **k: wrong_when_batched(q, *a[:5], 16),
                                    paged_decode_attention_torch)
    result = ch03b._check_kernel_in_engine("split_k_decode", "paged_decode_attention", recorder, "decode kernel")
    assert result.status == "FAIL"
    assert "differs from minipd's kernel at call 0 (layer 0, 3 query rows)" in result.message
    assert result.max_diff is not None and result.max_diff > 0.01 and result.first_mismatch is not None


def test_engine_stage_catches_a_prefill_kernel_wrong_only_for_later_chunks() -> None:
    recorder = ch03b.KernelRecorder(lambda *a, **k: prefill_mask_from_chunk_start(*a[:7]),
                                    paged_prefill_attention_torch)
    result = ch03b._check_kernel_in_engine("paged_prefill_attention", "paged_prefill_attention", recorder,
                                           "prefill kernel", max_num_batched_tokens=ch03b.PREFILL_CHUNK)
    assert result.status == "FAIL" and "prefill kernel: differs from minipd's kernel at call" in result.message


def test_engine_stage_names_a_bad_return_and_an_exception() -> None:
    recorder = ch03b.KernelRecorder(lambda q, *a, **k: q[:, :1], paged_decode_attention_torch)
    result = ch03b._check_kernel_in_engine("split_k_decode", "paged_decode_attention", recorder, "decode kernel")
    assert result.status == "FAIL" and "your kernel returned" in result.message and "expected the same shape" in \
        result.message
    recorder = ch03b.KernelRecorder(lambda *a, **k: 1 / 0, paged_decode_attention_torch)
    result = ch03b._check_kernel_in_engine("split_k_decode", "paged_decode_attention", recorder, "decode kernel")
    assert result.status == "FAIL" and "ZeroDivisionError" in result.message


def test_the_shared_torch_backend_is_never_changed() -> None:
    ch03b.check_split_k_decode(lambda *a: 1 / 0 if a[0].shape[0] == 2 else ch03b.reference_split_k_decode(*a))
    assert TORCH_BACKEND.paged_decode_attention is paged_decode_attention_torch
    assert TORCH_BACKEND.paged_prefill_attention is paged_prefill_attention_torch


# --- the references agree with minipd's kernels --------------------------------------------------


def test_split_k_reference_does_not_depend_on_the_split() -> None:
    g = torch.Generator().manual_seed(3)
    k, v, tables = ch03b._pool(g, [37, 5], 8, 2, 16)
    q = torch.randn(2, 4, 16, generator=g)
    lens = torch.tensor([37, 5])
    expected = paged_decode_attention_torch(q, k, v, tables, lens, 0.3)
    for split in (1, 3, 8, 16, 100):
        assert torch.allclose(ch03b.reference_split_k_decode(q, k, v, tables, lens, 0.3, split), expected, atol=1e-5)


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
