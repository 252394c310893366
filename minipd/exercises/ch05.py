"""Chapter 05 exercises: the KV bytes a disaggregated request moves, when its K/V are ready on the decode
side (after the prefill, or layer by layer), and which decode worker the router picks.

Each exercise has a reference solution (``reference_<name>``, written plainly so a stuck reader can
read it) and a checker (``check_<name>(fn)``) that runs the reader's function on fixed cases, edge
cases included, and prints PASS, FAIL (the largest difference and the first case that differs) or
TODO. ``reference_kv_transfer_bytes`` counts what :class:`minipd.DisaggregatedLLM` moves (whole
blocks of the prompt; ``tests/test_exercises_ch05.py`` compares it with a real run), and
``reference_route_decode`` makes the choice of its router (most free blocks, the first on ties).
"""

from __future__ import annotations

from collections.abc import Callable

from minipd.exercises.ch04 import _check_numbers
from minipd.exercises.checking import Case, CheckResult, call_reader, report

__all__ = [
    "LINKS",
    "MODEL_SHAPES",
    "check_kv_ready_time",
    "check_kv_transfer_bytes",
    "check_route_decode",
    "reference_kv_ready_time",
    "reference_kv_transfer_bytes",
    "reference_route_decode",
]

#: The KV-relevant shape of real models, from their public config.json files on the Hugging Face hub.
#: DeepSeek-V3 uses multi-head latent attention (MLA): one compressed latent of ``kv_lora_rank``
#: values plus a shared ``qk_rope_head_dim`` rotary key per token and layer, instead of K and V per head.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "Llama-2-7B": dict(num_hidden_layers=32, num_key_value_heads=32, head_dim=128),  # MHA: 32 KV heads
    "Llama-3-8B": dict(num_hidden_layers=32, num_key_value_heads=8, head_dim=128),
    "Llama-3-70B": dict(num_hidden_layers=80, num_key_value_heads=8, head_dim=128),
    "Qwen3-32B": dict(num_hidden_layers=64, num_key_value_heads=8, head_dim=128),
    "DeepSeek-V3": dict(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64),
}

#: Link bandwidths in bytes/s (one direction): PCIe Gen5 x16 ~64 GB/s, NVLink 4 (H100) 900 GB/s
#: in all, one 400 Gb/s InfiniBand or RoCE NIC ~50 GB/s.
LINKS: dict[str, float] = {"400G IB/RoCE": 50e9, "PCIe Gen5 x16": 64e9, "NVLink 4": 900e9}


# --- reference solutions ------------------------------------------------------------------------


def reference_kv_transfer_bytes(shape: dict[str, int], prompt_len: int, block_size: int = 16,
                                dtype_bytes: int = 2) -> int:
    """Bytes a decode worker reads to continue a request whose ``prompt_len`` prompt tokens were prefilled.

    The cache is paged, and whole blocks move: ``ceil(prompt_len / block_size)`` blocks of
    ``block_size`` tokens (``block_size=1`` counts exact tokens). One token keeps, in every layer,
    K and V for each KV head (``2 · num_key_value_heads · head_dim`` values), or, for MLA (a shape
    with ``kv_lora_rank``), one latent and one rotary key (``kv_lora_rank + qk_rope_head_dim`` values).
    """
    if "kv_lora_rank" in shape:
        values_per_layer = shape["kv_lora_rank"] + shape["qk_rope_head_dim"]
    else:
        values_per_layer = 2 * shape["num_key_value_heads"] * shape["head_dim"]
    bytes_per_token = shape["num_hidden_layers"] * values_per_layer * dtype_bytes
    num_blocks = -(-prompt_len // block_size)
    return num_blocks * block_size * bytes_per_token


def reference_kv_ready_time(prefill_s: float, transfer_s: float, num_layers: int, mode: str) -> float:
    """Seconds from the start of the prefill until the decode worker holds all of the prompt's K/V.

    ``"pull"``: the transfer starts when the whole prefill is done: ``prefill_s + transfer_s``.
    ``"layerwise"``: layer ``i``'s K/V are sent as soon as layer ``i`` is computed, one layer's
    transfer at a time on the link. With ``c = prefill_s / num_layers`` and ``t = transfer_s /
    num_layers``, the last layer's K/V arrive at ``c + t + (num_layers - 1) · max(c, t)``: if the link is
    faster than the compute, only one layer's transfer shows; if slower, the link sets the pace.
    """
    if mode == "pull":
        return prefill_s + transfer_s
    if mode == "layerwise":
        c, t = prefill_s / num_layers, transfer_s / num_layers
        return c + t + (num_layers - 1) * max(c, t)
    raise ValueError(f"mode must be 'pull' or 'layerwise', got {mode!r}")


def reference_route_decode(free_blocks: list[int], request_tokens: list[int], block_size: int = 16) -> list[int]:
    """The decode worker (its index) each request goes to, in order, as :class:`minipd.DisaggregatedLLM` routes.

    Each request goes to the worker with the most free KV blocks (the lowest index on ties); that
    worker then has ``ceil(tokens / block_size)`` fewer free blocks (the router reserves them before
    the K/V arrive, so the next request is not routed as if they were free). ``request_tokens`` counts
    each request's prompt and first token.
    """
    free = list(free_blocks)
    choices = []
    for tokens in request_tokens:
        worker = max(range(len(free)), key=lambda w: free[w])  # max keeps the first of equal values
        free[worker] -= -(-tokens // block_size)
        choices.append(worker)
    return choices


# --- cases --------------------------------------------------------------------------------------

#: tiny-py, the bundled model: 6 layers, 2 KV heads of 32 dims, an fp32 cache.
TINY_PY = dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=32)


def _bytes_cases() -> list[Case]:
    cases = [
        Case("tiny-py, 8 tokens (one block, fp32)", (TINY_PY, 8, 16, 4)),
        Case("tiny-py, 512 tokens (32 full blocks, fp32)", (TINY_PY, 512, 16, 4)),
        Case("tiny-py, 17 tokens: a second, nearly empty block", (TINY_PY, 17, 16, 4)),
        Case("Llama-3-8B, 1 token, exact (block_size 1)", (MODEL_SHAPES["Llama-3-8B"], 1, 1, 2)),
    ]
    for name, shape in MODEL_SHAPES.items():
        cases.append(Case(f"{name}, 4000 tokens, blocks of 16, bf16", (shape, 4000, 16, 2)))
    cases += [
        Case("Llama-3-70B, 1000 tokens, int8 cache, blocks of 256", (MODEL_SHAPES["Llama-3-70B"], 1000, 256, 1)),
        Case("DeepSeek-V3, 1 token, exact", (MODEL_SHAPES["DeepSeek-V3"], 1, 1, 2)),
        Case("DeepSeek-V3, 300 tokens, blocks of 64", (MODEL_SHAPES["DeepSeek-V3"], 300, 64, 2)),
    ]
    return cases


def _ready_cases() -> list[Case]:
    return [
        Case("pull: prefill then transfer", (0.2, 0.05, 32, "pull")),
        Case("layerwise, fast link: one layer's transfer shows", (0.32, 0.032, 32, "layerwise")),
        Case("layerwise, slow link: the link sets the pace", (0.1, 0.4, 40, "layerwise")),
        Case("layerwise, link as fast as compute", (0.3, 0.3, 30, "layerwise")),
        Case("layerwise, one layer: nothing to overlap", (0.2, 0.05, 1, "layerwise")),
        Case("pull, no transfer at all", (0.2, 0.0, 32, "pull")),
        Case("layerwise, 80 layers", (1.6, 0.2, 80, "layerwise")),
    ]


def _route_cases() -> list[Case]:
    return [
        Case("two equal workers: the first wins the tie", ([100, 100], [20])),
        Case("alternating as blocks are reserved", ([100, 100], [20, 20, 20, 20])),
        Case("one worker much emptier", ([200, 50], [40, 40, 40, 40])),
        Case("three workers, mixed lengths", ([64, 80, 72], [300, 17, 16, 1, 100, 33])),
        Case("a single worker", ([30], [5, 5, 5])),
        Case("blocks of 32", ([10, 12], [64, 33, 31, 100], 32)),
        Case("nothing to route", ([10, 10], [])),
    ]


# --- checking -----------------------------------------------------------------------------------


def check_kv_transfer_bytes(fn: Callable[..., int]) -> CheckResult:
    """Check ``fn(shape, prompt_len, block_size, dtype_bytes) -> bytes`` against :func:`reference_kv_transfer_bytes`."""
    return report(_check_numbers("kv_transfer_bytes", fn, reference_kv_transfer_bytes, _bytes_cases(), 0, int))


def check_kv_ready_time(fn: Callable[..., float]) -> CheckResult:
    """Check ``fn(prefill_s, transfer_s, num_layers, mode) -> seconds`` against :func:`reference_kv_ready_time`."""
    return report(_check_numbers("kv_ready_time", fn, reference_kv_ready_time, _ready_cases(), 1e-9,
                                 (int, float)))


def check_route_decode(fn: Callable[..., list[int]]) -> CheckResult:
    """Check ``fn(free_blocks, request_tokens, block_size) -> [worker, ...]`` choice by choice."""
    name = "route_decode"
    for index, case in enumerate(_route_cases()):
        expected = reference_route_decode(*case.args)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        if not isinstance(actual, list | tuple) or not all(isinstance(w, int) and not isinstance(w, bool)
                                                           for w in actual):
            return report(CheckResult("FAIL", name, f"returned {actual!r}; expected a list of worker indices "
                                                    f"[case: {case.label}]"))
        got = list(actual)
        if got == expected:
            continue
        where = next((i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e),
                     min(len(got), len(expected)))
        diffs = [abs(g - e) for g, e in zip(got, expected, strict=False)]
        max_diff = float(max(diffs + ([float("inf")] if len(got) != len(expected) else []), default=0))
        got_item = got[where] if where < len(got) else "nothing"
        want_item = expected[where] if where < len(expected) else "nothing"
        message = (f"max |diff| {max_diff:.4g}; first mismatch in case {index} ({case.label}) at request {where}: "
                   f"got worker {got_item}, expected {want_item}; whole answer {got}, expected {expected}")
        return report(CheckResult("FAIL", name, message, max_diff=max_diff, first_mismatch=where))
    return report(CheckResult("PASS", name, max_diff=0.0))

