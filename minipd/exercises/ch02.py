"""Chapter 02 exercises: counting what a decode step costs, from the model's shape alone.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck
reader can read it) and a checker (``check_<name>(fn)``) that runs the reader's function on fixed
model shapes (tiny-py's and real ones: Llama-2-7B, Llama-3-8B, Qwen3-0.6B) and prints PASS, FAIL
or TODO. The checkers compare against the cost model in :mod:`minipd.sim.costs`, so a PASS means
"counts like minipd".

The exercises are about dense models with full attention (no sliding window, no experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from minipd.config import ModelConfig
from minipd.exercises.checking import Case, CheckResult, call_reader, report
from minipd.sim import costs

__all__ = [
    "TINY_PY_SHAPE",
    "check_arithmetic_intensity",
    "check_decode_bytes",
    "check_decode_flops",
    "check_kv_bytes_per_token",
    "reference_arithmetic_intensity",
    "reference_decode_bytes",
    "reference_decode_flops",
    "reference_kv_bytes_per_token",
]

#: The shape of the bundled tiny-py model (``scripts/train_tiny.py``), so the checks need no files.
TINY_PY_SHAPE = ModelConfig.from_dict(dict(
    model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True))


# --- reference solutions ------------------------------------------------------------------------


def reference_kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes one token adds to the KV cache: a K and a V vector per KV head, in every layer."""
    per_layer = 2 * config.num_key_value_heads * config.head_dim  # K and V, one head_dim vector per KV head
    return config.num_hidden_layers * per_layer * dtype_bytes


def reference_decode_flops(config: ModelConfig, batch: int, context: int) -> int:
    """Matmul FLOPs of one decode step: ``batch`` sequences, one new token each, ``context`` keys each.

    2 FLOPs per multiply-add. Per token: every weight of q/k/v/o and the MLP in every layer, plus
    the LM head (tied or not, it is a ``hidden × vocab`` product); attention multiplies the query by
    ``context`` keys and the weights by ``context`` values in each query head of each layer.
    """
    h, q_dim = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    projections = h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    weights_per_token = config.num_hidden_layers * (projections + mlp) + h * config.vocab_size  # + LM head
    linear = 2 * weights_per_token * batch
    attention = config.num_hidden_layers * 2 * (2 * q_dim * context) * batch  # q·kᵀ and weights·v
    return linear + attention


def reference_decode_bytes(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
    """Least bytes one decode step moves: weights once, the cached K/V read, the new K/V written.

    Weights: every parameter except the embedding table, plus the LM head matrix (which *is* the
    embedding table when the two are tied). Activations are left out.
    """
    params = costs.count_parameters(config)
    weights = (params.non_embedding + config.vocab_size * config.hidden_size) * dtype_bytes
    per_token = reference_kv_bytes_per_token(config, dtype_bytes)
    return weights + batch * context * per_token + batch * per_token


def reference_arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte, as a float."""
    return flops / bytes_moved


# --- checking numbers -----------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _fmt(value: Any) -> str:
    """``1,234,567`` for counts, ``1.5`` for ratios; whatever the number type."""
    try:
        return f"{value:,}" if float(value).is_integer() else f"{float(value):.6g}"
    except (TypeError, ValueError, OverflowError):
        return repr(value)


def check_number_fn(name: str, fn: Callable[..., Any], reference: Callable[..., float], cases: Sequence[Case],
                    rtol: float = 0.0) -> CheckResult:
    """Check a reader's function that returns one number against ``reference`` on every case.

    Exact by default (``rtol=0``: counts of FLOPs and bytes are integers); an ``int`` and an equal
    ``float`` both pass. ``first_mismatch`` is the index of the first failing case.
    """
    for index, case in enumerate(cases):
        expected = reference(*case.args, **case.kwargs)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return failure
        where = f"[case {index}: {case.label}]"
        if not _is_number(actual):
            return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected a number {where}")
        tol = (rtol if case.rtol is None else case.rtol) * abs(expected)
        diff = abs(float(actual) - float(expected)) if math.isfinite(actual) else math.inf
        if not diff <= tol:
            message = (f"|diff| {diff:.3g}; first mismatch at case {index}: got {_fmt(actual)}, "
                       f"expected {_fmt(expected)} {where}")
            return CheckResult("FAIL", name, message, max_diff=diff, first_mismatch=index)
    return CheckResult("PASS", name, max_diff=0.0)


_SHAPES = {"tiny-py": TINY_PY_SHAPE, **{n: costs.preset(n) for n in ("llama-2-7b", "llama-3-8b", "qwen3-0.6b")}}


def _kv_cases() -> list[Case]:
    return [
        Case("tiny-py, fp32", (_SHAPES["tiny-py"], 4)),
        Case("llama-2-7b (one KV head per query head), fp16", (_SHAPES["llama-2-7b"], 2)),
        Case("llama-3-8b (grouped-query), bf16", (_SHAPES["llama-3-8b"], 2)),
        Case("qwen3-0.6b (head_dim 128, not hidden/heads), int8", (_SHAPES["qwen3-0.6b"], 1)),
    ]


def _decode_cases(with_dtype: bool) -> list[Case]:
    rows = [("tiny-py", 1, 1, 4), ("tiny-py", 32, 100, 4), ("llama-2-7b", 4, 2048, 2), ("llama-3-8b", 1, 512, 2),
            ("llama-3-8b", 64, 4096, 2), ("qwen3-0.6b", 8, 1000, 2)]
    cases = []
    for shape, batch, context, dtype_bytes in rows:
        args = (_SHAPES[shape], batch, context) + ((dtype_bytes,) if with_dtype else ())
        label = f"{shape}, batch {batch}, context {context}" + (f", {dtype_bytes}-byte dtype" if with_dtype else "")
        cases.append(Case(label, args))
    return cases


def _intensity_cases() -> list[Case]:
    return [Case("3 FLOPs over 2 bytes", (3, 2)), Case("1e12 FLOPs over 4e9 bytes", (10**12, 4 * 10**9)),
            Case("no FLOPs", (0, 5)), Case("floats", (7.5e14, 1.6e10))]


# --- checkers -------------------------------------------------------------------------------------


def check_kv_bytes_per_token(fn: Callable[[ModelConfig, int], int]) -> CheckResult:
    """Check ``fn(config, dtype_bytes)``: bytes of K and V one token keeps in the cache."""
    return report(check_number_fn("kv_bytes_per_token", fn, costs.kv_bytes_per_token, _kv_cases()))


def check_decode_flops(fn: Callable[[ModelConfig, int, int], int]) -> CheckResult:
    """Check ``fn(config, batch, context)``: matmul FLOPs of one decode step."""
    def reference(config: ModelConfig, batch: int, context: int) -> int:
        return costs.decode_cost(config, batch, context).flops

    return report(check_number_fn("decode_flops", fn, reference, _decode_cases(with_dtype=False)))


def check_decode_bytes(fn: Callable[[ModelConfig, int, int, int], int]) -> CheckResult:
    """Check ``fn(config, batch, context, dtype_bytes)``: weight and KV bytes of one decode step."""
    def reference(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
        c = costs.decode_cost(config, batch, context, dtype_bytes)
        return c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes

    return report(check_number_fn("decode_bytes", fn, reference, _decode_cases(with_dtype=True)))


def check_arithmetic_intensity(fn: Callable[[float, float], float]) -> CheckResult:
    """Check ``fn(flops, bytes_moved)``: FLOPs per byte."""
    return report(check_number_fn("arithmetic_intensity", fn, costs.arithmetic_intensity, _intensity_cases(),
                                  rtol=1e-12))
