"""Chapter 02 checkers against planted bugs (the three states of every checker: test_exercise_states.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from minipd.config import ModelConfig
from minipd.exercises import ch02
from minipd.exercises.checking import CheckResult


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch02, f"check_{name}")


def stub(*args: Any) -> Any:
    raise NotImplementedError


def test_a_float_equal_to_the_count_passes() -> None:
    assert ch02.check_kv_bytes_per_token(lambda c, b: float(ch02.reference_kv_bytes_per_token(c, b))).passed


# --- planted bugs --------------------------------------------------------------------------------


def kv_without_v(config: ModelConfig, dtype_bytes: int) -> int:
    """Caches K only."""
    return config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


def kv_per_query_head(config: ModelConfig, dtype_bytes: int) -> int:
    """Ignores grouped-query attention: one K/V per query head."""
    return 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * dtype_bytes


def kv_head_dim_from_hidden(config: ModelConfig, dtype_bytes: int) -> int:
    """Takes head_dim as hidden / heads, which Qwen3 does not."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def flops_without_lm_head(config: ModelConfig, batch: int, context: int) -> int:
    return ch02.reference_decode_flops(config, batch, context) - 2 * batch * config.hidden_size * config.vocab_size


def flops_attention_per_kv_head(config: ModelConfig, batch: int, context: int) -> int:
    """Counts attention per KV head, as if grouped query heads shared their products."""
    full = ch02.reference_decode_flops(config, batch, context)
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    return full - 4 * config.num_hidden_layers * batch * context * (q_dim - kv_dim)


def flops_one_per_multiply_add(config: ModelConfig, batch: int, context: int) -> int:
    return ch02.reference_decode_flops(config, batch, context) // 2


def bytes_weights_per_sequence(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
    """Reads the weights once per sequence instead of once per step: batching would gain nothing."""
    one = ch02.reference_decode_bytes(config, 1, context, dtype_bytes)
    return batch * one


def bytes_without_tied_lm_head(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
    """Drops the embedding table even when it doubles as the LM head."""
    full = ch02.reference_decode_bytes(config, batch, context, dtype_bytes)
    if config.tie_word_embeddings:
        full -= config.vocab_size * config.hidden_size * dtype_bytes
    return full


def bytes_without_kv_write(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
    return (ch02.reference_decode_bytes(config, batch, context, dtype_bytes)
            - batch * ch02.reference_kv_bytes_per_token(config, dtype_bytes))


def intensity_floor_division(flops: float, bytes_moved: float) -> float:
    return flops // bytes_moved


def intensity_upside_down(flops: float, bytes_moved: float) -> float:
    return bytes_moved / flops if flops else 0.0


@pytest.mark.parametrize(("name", "bug"), [
    ("kv_bytes_per_token", kv_without_v),
    ("kv_bytes_per_token", kv_per_query_head),
    ("kv_bytes_per_token", kv_head_dim_from_hidden),
    ("decode_flops", flops_without_lm_head),
    ("decode_flops", flops_attention_per_kv_head),
    ("decode_flops", flops_one_per_multiply_add),
    ("decode_bytes", bytes_weights_per_sequence),
    ("decode_bytes", bytes_without_tied_lm_head),
    ("decode_bytes", bytes_without_kv_write),
    ("arithmetic_intensity", intensity_floor_division),
    ("arithmetic_intensity", intensity_upside_down),
])
def test_planted_bug_fails_with_where(name: str, bug: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL"
    assert result.max_diff is not None and result.max_diff > 0
    assert isinstance(result.first_mismatch, int)
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {name}: |diff| ")
    assert f"first mismatch at case {result.first_mismatch}:" in out


def test_fail_message_names_the_case(capsys: pytest.CaptureFixture[str]) -> None:
    result = ch02.check_kv_bytes_per_token(kv_head_dim_from_hidden)
    # tiny-py, Llama-2 and Llama-3 have head_dim = hidden / heads; Qwen3-0.6B (case 3) does not.
    assert result.first_mismatch == 3
    assert "got 28,672, expected 57,344 [case 3: qwen3-0.6b" in capsys.readouterr().out


def test_exception_in_reader_code_is_a_fail(capsys: pytest.CaptureFixture[str]) -> None:
    def broken(config: ModelConfig, batch: int, context: int) -> int:
        return config.num_layers  # no such field

    result = ch02.check_decode_flops(broken)
    assert result.status == "FAIL"
    assert "AttributeError" in result.message and "in broken" in result.message
