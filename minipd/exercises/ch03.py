"""Chapter 03 exercises: sizing the KV cache, paging it, and finding a cached prefix.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck
reader can read it) and a checker (``check_<name>(fn)``) that runs the reader's function on fixed
inputs, including edge cases, and prints PASS, FAIL or TODO. Where the engine has the same logic
the checker compares against it: :meth:`minipd.config.ModelConfig.kv_bytes_per_token`, the slot
arithmetic of :mod:`minipd.engine.model_runner`, and
:meth:`minipd.kv.block_manager.BlockManager.find_cached_prefix` (the tests hold the reference equal to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

import torch

from minipd.config import ModelConfig
from minipd.exercises.checking import Case, CheckResult, call_reader, check_tensor_fn, report
from minipd.kv.block_manager import BlockAllocation, BlockManager, chain_hash

__all__ = [
    "check_blocks_needed",
    "check_kv_bytes_per_token",
    "check_longest_cached_prefix",
    "check_slot_mapping",
    "reference_blocks_needed",
    "reference_kv_bytes_per_token",
    "reference_longest_cached_prefix",
    "reference_slot_mapping",
]


# --- reference solutions ------------------------------------------------------------------------


def reference_kv_bytes_per_token(config: ModelConfig, bytes_per_element: int) -> int:
    """Bytes one token keeps in the cache: a K and a V vector per KV head, in every layer."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_element


def reference_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that ``num_tokens`` tokens occupy: the ceiling of the division."""
    return (num_tokens + block_size - 1) // block_size


def reference_slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slot of each position: ``block_table[p // block_size] * block_size + p % block_size``.

    ``block_table`` (num_blocks,) lists the sequence's physical blocks in order; ``positions`` (N,)
    are token positions in the sequence. Returns (N,) int64.
    """
    physical_block = block_table.long()[positions // block_size]
    return physical_block * block_size + positions % block_size


def reference_longest_cached_prefix(token_ids: Sequence[int], cached: dict[int, int], block_size: int) -> list[int]:
    """Block ids of the longest run of leading full blocks whose chained hashes are in ``cached``.

    ``cached`` maps a block's chained hash (:func:`minipd.kv.block_manager.chain_hash`) to the
    physical block holding it. The search stops at the first miss, and never covers the last token:
    its logits are needed to sample the next token, so it must be computed.
    """
    found: list[int] = []
    parent = None
    usable = (len(token_ids) - 1) // block_size  # full blocks that leave at least one token over
    for index in range(usable):
        block_tokens = token_ids[index * block_size:(index + 1) * block_size]
        parent = chain_hash(parent, block_tokens)
        if parent not in cached:
            break
        found.append(cached[parent])
    return found


# --- comparing plain Python answers --------------------------------------------------------------


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (Python, numpy or 0-d torch), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, Integral):
        return int(value)
    return None


def _compare_ints(name: str, actual: Any, expected: int, where: str) -> CheckResult | None:
    got = _as_int(actual)
    if got is None:
        return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected an int {where}")
    if got != expected:
        diff = abs(got - expected)
        return CheckResult("FAIL", name, f"got {got}, expected {expected} (diff {diff}) {where}", max_diff=float(diff))
    return None


def _compare_int_lists(name: str, actual: Any, expected: list[int], where: str) -> CheckResult | None:
    if isinstance(actual, torch.Tensor):
        actual = actual.tolist()
    if not isinstance(actual, list | tuple) or any(_as_int(v) is None for v in actual):
        return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected a list of block ids {where}")
    got = [_as_int(v) for v in actual]
    if got == expected:
        return None
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got),
                                                                                                    len(expected)))
    message = f"got {got}, expected {expected}; first mismatch at position {first} {where}"
    return CheckResult("FAIL", name, message, first_mismatch=first)


def _check_values(name: str, fn: Callable[..., Any], reference: Callable[..., Any], cases: Sequence[Case]
                  ) -> CheckResult:
    """Run ``fn`` and ``reference`` on every case; exact comparison of ints or lists of ints."""
    for case in cases:
        expected = reference(*case.args, **case.kwargs)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return failure
        where = f"[case: {case.label}]"
        compare = _compare_ints if isinstance(expected, int) else _compare_int_lists
        failure = compare(name, actual, expected, where)
        if failure is not None:
            return failure
    return CheckResult("PASS", name)


# --- inputs, including edge cases ---------------------------------------------------------------


def _config(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int) -> ModelConfig:
    return ModelConfig(model_type=name, vocab_size=1000, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, max_position_embeddings=4096)


def _kv_bytes_cases() -> list[Case]:
    llama8b = _config("llama", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096)
    llama70b = _config("llama", layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192)
    # Qwen3 sets head_dim explicitly: 128, not hidden_size / heads = 64.
    qwen3 = _config("qwen3", layers=28, heads=16, kv_heads=8, head_dim=128, hidden=1024)
    mha = _config("llama", layers=12, heads=12, kv_heads=12, head_dim=64, hidden=768)
    return [
        Case("Llama-3-8B shapes, bf16 (2 bytes)", (llama8b, 2)),
        Case("Llama-3-70B shapes, fp8 (1 byte)", (llama70b, 1)),
        Case("Qwen3-0.6B shapes (head_dim 128 != hidden/heads), bf16", (qwen3, 2)),
        Case("plain multi-head attention (kv heads = query heads), fp32", (mha, 4)),
    ]


def _blocks_cases() -> list[Case]:
    return [
        Case("0 tokens", (0, 16)),
        Case("1 token", (1, 16)),
        Case("exactly one full block (16 of 16)", (16, 16)),
        Case("one token into a second block (17 of 16)", (17, 16)),
        Case("1000 tokens in blocks of 256", (1000, 256)),
        Case("block size 1", (37, 1)),
    ]


def _slot_cases(g: torch.Generator) -> list[Case]:
    table = torch.randperm(12, generator=g)[:5].to(torch.int32)  # 5 shuffled physical blocks
    return [
        Case("prefill of 19 tokens, block size 4, shuffled table", (table, torch.arange(19), 4)),
        Case("one decode position in the middle of a block", (table, torch.tensor([13]), 4)),
        Case("a prefill chunk starting mid-block (positions 6..17)", (table, torch.arange(6, 18), 4)),
        Case("block size 1", (table, torch.tensor([4, 0, 2]), 1)),
        Case("block size 16, positions out of order", (table, torch.tensor([70, 3, 16, 47]), 16)),
    ]


def _prefix_cases() -> list[Case]:
    """Queries against the hash table of a real :class:`BlockManager` (block size 4)."""
    bs = 4
    bm = BlockManager(num_blocks=16, block_size=bs)
    first = list(range(100, 114))  # 14 tokens: three full blocks, then two tokens
    second = [*first[:4], 7, 7, 7, 7, 8]  # shares only the first block
    for tokens in (first, second):
        alloc = BlockAllocation()
        assert bm.allocate(alloc, len(tokens), bm.find_cached_prefix(tokens))
        bm.register_full_blocks(alloc, tokens, len(tokens))
    cached = dict(bm.cached)
    # The same table after the middle block of ``first`` was evicted: the chain is broken there.
    gap = dict(cached)
    gap.pop(chain_hash(chain_hash(None, first[:4]), first[4:8]))
    return [
        Case("a prompt extending the 14 cached tokens: three blocks hit", ([*first, 1, 2], cached, bs)),
        Case("exactly 12 cached tokens: the last token must be computed, two blocks", (first[:12], cached, bs)),
        Case("shares one block, then differs", ([*first[:4], 5, 5, 5, 5, 5], cached, bs)),
        Case("the other sequence's second block", ([*second, 9], cached, bs)),
        Case("same second block after a different first block (hashes are chained)",
             ([0, 0, 0, 0, *first[4:8], 1], cached, bs)),
        Case("middle block evicted: stop at the first miss", ([*first, 1], gap, bs)),
        Case("shorter than a block", (first[:3], cached, bs)),
        Case("a single token", ([100], cached, bs)),
    ]


# --- checkers -----------------------------------------------------------------------------------


def check_kv_bytes_per_token(fn: Callable[[ModelConfig, int], int]) -> CheckResult:
    """Check ``fn(config, bytes_per_element) -> int`` against ``ModelConfig.kv_bytes_per_token``."""
    def minipd_bytes(config: ModelConfig, bytes_per_element: int) -> int:
        return config.kv_bytes_per_token(bytes_per_element)

    return report(_check_values("kv_bytes_per_token", fn, minipd_bytes, _kv_bytes_cases()))


def check_blocks_needed(fn: Callable[[int, int], int]) -> CheckResult:
    """Check ``fn(num_tokens, block_size) -> int``."""
    return report(_check_values("blocks_needed", fn, reference_blocks_needed, _blocks_cases()))


def check_slot_mapping(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> CheckResult:
    """Check ``fn(block_table, positions, block_size) -> (N,) int64`` slot by slot, exactly."""
    return report(check_tensor_fn("slot_mapping", fn, reference_slot_mapping, _slot_cases, atol=0.0, rtol=0.0))


def check_longest_cached_prefix(fn: Callable[[list[int], dict[int, int], int], list[int]]) -> CheckResult:
    """Check ``fn(token_ids, cached, block_size) -> block ids``; ``cached`` comes from a real :class:`BlockManager`."""
    cases = _prefix_cases()
    return report(_check_values("longest_cached_prefix", fn, reference_longest_cached_prefix, cases))
