"""Chapter 06 exercises: compressing the KV cache — 8-bit codes with a scale per token, a press that keeps
only the most recent blocks, and the bytes a compressed cache moves between prefill and decode.

Each exercise has a reference solution (``reference_<name>``, written plainly so a stuck reader can
read it) and a checker (``check_<name>(fn)``) that runs the reader's function on fixed cases, edge
cases included, and prints PASS, FAIL (the largest difference and the first place the answers part)
or TODO. Two checkers then plug the reader's function into minipd itself and compare a greedy run of
the bundled ``tiny-py`` model with the same run using the reference: ``check_quantize_int8`` stands in
for the engine's int8 format (:data:`minipd.kv.quant.FORMATS`), ``check_recent_window_score`` is the
press of an evicting engine (:class:`minipd.kv.press.KVPress`). ``reference_compressed_transfer_bytes``
counts what :class:`minipd.kv.spec.KVSpec` counts (``tests/test_exercises_ch06.py`` compares them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minipd import LLM, SamplingParams
from minipd.exercises.ch04 import _check_numbers
from minipd.exercises.ch05 import MODEL_SHAPES, TINY_PY
from minipd.exercises.checking import Case, CheckResult, call_reader, describe_exception, report, tensor_mismatch, todo
from minipd.kv import quant
from minipd.kv.press import KVPress, blocks_to_drop

__all__ = [
    "VALUE_BYTES",
    "RecentWindowPress",
    "check_compressed_transfer_bytes",
    "check_quantize_int8",
    "check_recent_window_score",
    "reference_compressed_transfer_bytes",
    "reference_quantize_int8",
    "reference_recent_window_score",
]

#: Bytes per stored value for each cache dtype the transfer exercise knows.
VALUE_BYTES: dict[str, int] = {"float32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


# --- reference solutions ------------------------------------------------------------------------


def reference_quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes for ``x`` (..., head_dim), with one fp16 scale per vector (per token, per KV head).

    Each vector's largest magnitude maps to code 127: ``scale = max|x| / 127``, clamped at ``2**-24``
    (the smallest fp16 number, so an all-zero vector does not divide by zero) and rounded to fp16
    *before* dividing, so that ``code * scale`` with the stored scale is what the codes were made for.
    Codes are ``round(x / scale)`` clamped to [-127, 127]. Returns ``(codes, scales)``: int8 of ``x``'s
    shape, and float16 of shape ``x.shape[:-1]``.
    """
    xf = x.float()
    scales = (xf.abs().amax(dim=-1) / 127).clamp_min(2.0**-24).to(torch.float16)
    codes = (xf / scales.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


def reference_recent_window_score(keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
    """A press score that keeps the most recent blocks (a sliding window, no attention sinks).

    Higher is kept, and the engine drops the lowest-scored blocks first, so a block's score is simply
    where it starts: the oldest block goes first. ``keys`` and ``num_tokens`` are not needed.
    Returns one float32 score per block, shape ``(len(first_positions),)``.
    """
    return torch.tensor(first_positions, dtype=torch.float32)


def reference_compressed_transfer_bytes(shape: dict[str, int], prompt_len: int, kv_cache_dtype: str,
                                        block_size: int = 16) -> int:
    """Bytes a decode worker reads for a prompt of ``prompt_len`` tokens when the cache is ``kv_cache_dtype``.

    Whole blocks move: ``ceil(prompt_len / block_size)`` of ``block_size`` tokens. A token keeps, in
    every layer, K and V for each KV head: ``head_dim`` values of ``VALUE_BYTES[kv_cache_dtype]`` bytes
    each, and, for the 8-bit formats (``"int8"``, ``"fp8"``), one 2-byte (fp16) scale beside them.
    ``shape`` has ``num_hidden_layers``, ``num_key_value_heads`` and ``head_dim``.
    """
    if kv_cache_dtype not in VALUE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, VALUE_BYTES))}, got {kv_cache_dtype!r}")
    scale_bytes = 2 if kv_cache_dtype in ("int8", "fp8") else 0
    per_head = shape["head_dim"] * VALUE_BYTES[kv_cache_dtype] + scale_bytes  # one K (or one V) of one head
    bytes_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * per_head
    num_blocks = -(-prompt_len // block_size)
    return num_blocks * block_size * bytes_per_token


# --- cases --------------------------------------------------------------------------------------


def _quantize_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    outliers = torch.randn(8, 2, 32, generator=gen)
    outliers[:, :, 3] *= 20  # one outlier channel, as real K caches have: it sets every row's scale
    zero = torch.randn(4, 2, 32, generator=gen)
    zero[1, 0] = 0
    tiny = torch.randn(4, 2, 32, generator=gen)
    tiny[2, 1] = 1e-9  # the clamp sets the scale
    tiny[3, 0] *= 1e-4  # a scale that fp16 can only hold as a subnormal: rounding it first matters most
    negative = -torch.randn(6, 2, 32, generator=gen).abs()
    negative[:, :, 7] = -50.0  # the largest magnitude is negative: code -127
    negative[5] = -3.0  # every value equal
    return [
        Case("random normal, 16 tokens x 2 KV heads x 32 dims", (torch.randn(16, 2, 32, generator=gen),)),
        Case("an outlier channel (x20)", (outliers,)),
        Case("an all-zero row (token 1, head 0)", (zero,)),
        Case("a row of 1e-9 and a row of ~1e-4", (tiny,)),
        Case("negative extremes", (negative,)),
        Case("a 2-D input (5 vectors of 64)", (torch.randn(5, 64, generator=gen),)),
    ]


#: The prompts of the int8 engine run: greedy, 24 tokens each.
QUANT_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
                 "import os\n\n\ndef list_files(path):\n"]


def _score_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1)

    def keys(n: int, block_size: int = 16) -> torch.Tensor:
        # (blocks, layers, block_size, kv_heads, head_dim), as the engine passes them.
        return torch.randn(n, 2, block_size, 2, 8, generator=gen)

    return [
        Case("4 blocks from the start", (keys(4), [0, 16, 32, 48], 70)),
        Case("gaps left by earlier evictions", (keys(4), [0, 16, 48, 64], 85)),
        Case("the first blocks already dropped", (keys(5), [32, 48, 64, 80, 96], 120)),
        Case("10 blocks of 8 tokens", (keys(10, 8), list(range(0, 80, 8)), 85)),
        Case("two blocks", (keys(2), [0, 16], 40)),
    ]


#: The evicting engine run: budget, tokens generated, and how many prompt tokens of this text.
EVICTION_BUDGET, EVICTION_MAX_TOKENS, EVICTION_PROMPT_LEN = 32, 40, 30
EVICTION_TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nclass Path:\n    pass\n" * 4


def _bytes_cases() -> list[Case]:
    cases = []
    for name, shape in (("tiny-py", TINY_PY), ("Llama-3-8B", MODEL_SHAPES["Llama-3-8B"])):
        for prompt_len in (1, 16, 17, 4096):
            for dtype in VALUE_BYTES:
                tokens = f"{prompt_len} token" + ("s" if prompt_len > 1 else "")
                cases.append(Case(f"{name}, {tokens}, {dtype}", (shape, prompt_len, dtype)))
    cases += [
        Case("Llama-3-70B, 1000 tokens, int8, blocks of 256", (MODEL_SHAPES["Llama-3-70B"], 1000, "int8", 256)),
        Case("Qwen3-32B, 3 tokens, fp8, exact (block_size 1)", (MODEL_SHAPES["Qwen3-32B"], 3, "fp8", 1)),
        Case("Llama-2-7B, 100 tokens, bf16, blocks of 32", (MODEL_SHAPES["Llama-2-7B"], 100, "bf16", 32)),
    ]
    return cases


# --- checking: quantize_int8 --------------------------------------------------------------------


class _ReaderFormat(quant.QuantFormat):
    """The engine's int8 format with the reader's ``quantize``: every other field and ``dequantize`` are
    the engine's own."""

    def __init__(self, base: quant.QuantFormat, quantize: Callable[[torch.Tensor], Any]) -> None:
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        object.__setattr__(self, "_quantize", quantize)  # the dataclass is frozen

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._quantize(x)


def _int8_engine_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [out.token_ids for out in llm.generate(QUANT_PROMPTS, params)]


def _check_int8_in_engine(name: str, fn: Callable[[torch.Tensor], Any]) -> CheckResult:
    """Greedy tokens of tiny-py with an int8 cache quantized by ``fn``, against the engine's own format."""
    # CPU and the torch kernels: the only backend that reads quantized caches, and the same answer everywhere.
    llm = LLM("tiny-py", device="cpu", kv_cache_dtype="int8", enable_prefix_caching=False, num_kv_blocks=64)
    expected = _int8_engine_tokens(llm)
    base = quant.FORMATS["int8"]
    quant.FORMATS["int8"] = _ReaderFormat(base, fn)  # type: ignore[assignment]
    try:
        actual = _int8_engine_tokens(llm)
    except NotImplementedError:
        return todo(name)
    except Exception as err:  # the reader's function broke inside the engine
        return CheckResult("FAIL", name, f"raised {describe_exception(err)} inside the engine "
                                         "(LLM('tiny-py', kv_cache_dtype='int8'))")
    finally:
        quant.FORMATS["int8"] = base
    for prompt, got, want in zip(QUANT_PROMPTS, actual, expected, strict=True):
        if got != want:
            first = next(i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w)
            return CheckResult("FAIL", name, f"right on every case, but plugged into the engine "
                                             f"(LLM('tiny-py', kv_cache_dtype='int8')) greedy token {first} for "
                                             f"prompt {prompt!r} differs: got {got[first]}, expected {want[first]}",
                               first_mismatch=first)
    return CheckResult("PASS", name, max_diff=0.0)


def check_quantize_int8(fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> CheckResult:
    """Check ``fn(x) -> (codes, scales)`` exactly against :func:`reference_quantize_int8`, then in the engine.

    Scales and codes must match bit for bit (dtype, shape, values). When every case does, ``fn`` takes
    the place of the engine's int8 format for a greedy run of ``tiny-py`` with ``kv_cache_dtype="int8"``
    (two prompts, 24 tokens each), which must give the tokens the engine's own format gives.
    """
    name = "quantize_int8"
    for case in _quantize_cases():
        expected = reference_quantize_int8(*case.args)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        where = f"[case: {case.label}]"
        if not isinstance(actual, tuple | list) or len(actual) != 2:
            return report(CheckResult("FAIL", name, f"returned {type(actual).__name__}; expected a pair "
                                                    f"(codes, scales) {where}"))
        # The scales first: a wrong scale makes the codes wrong too, and is the thing to fix.
        for what, got, want in (("scales", actual[1], expected[1]), ("codes", actual[0], expected[0])):
            failure, _ = tensor_mismatch(name, got, want, 0.0, 0.0, where, subject=f"{what}:")
            if failure is not None:
                return report(failure)
    return report(_check_int8_in_engine(name, fn))


# --- checking: recent_window_score --------------------------------------------------------------


class RecentWindowPress(KVPress):
    """A press whose score is ``fn`` (the reference by default): ``LLM(kv_eviction=RecentWindowPress(fn), ...)``.

    ``fn`` is an attribute, so the checker can swap it between runs of one engine.
    """

    name = "recent-window"

    def __init__(self, fn: Callable[..., torch.Tensor] = reference_recent_window_score) -> None:
        self.fn = fn

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        return self.fn(keys.clone(), list(first_positions), num_tokens)


def _evicting_run(llm: LLM, prompt: list[int]) -> tuple[list[int], list[tuple[int, list[int], list[int]]]]:
    """Greedy tokens of ``prompt``, stepping the engine, and after each step (tokens so far, kept block
    positions, dropped block positions)."""
    params = SamplingParams(temperature=0, max_tokens=EVICTION_MAX_TOKENS, ignore_eos=True)
    engine = llm.engine
    state = engine.make_request(prompt, params)
    engine.add(state)
    trace = []
    while not state.finished:
        engine.step()
        if not state.finished:
            blocks = state.request.blocks
            trace.append((state.request.num_computed_tokens, blocks.block_positions(engine.config.block_size),
                          list(blocks.dropped_positions)))
    return list(state.token_ids), trace


def _check_press_in_engine(name: str, fn: Callable[..., torch.Tensor]) -> CheckResult:
    """Run tiny-py with ``fn`` as its press: the most recent blocks kept at every step, the reference's tokens."""
    press = RecentWindowPress()
    llm = LLM("tiny-py", device="cpu", kv_eviction=press, kv_budget=EVICTION_BUDGET, enable_prefix_caching=False,
              num_kv_blocks=64)
    prompt = llm.tokenizer.encode(EVICTION_TEXT)[:EVICTION_PROMPT_LEN]
    expected, _ = _evicting_run(llm, prompt)
    press.fn = fn
    engine = f"(LLM('tiny-py', kv_eviction=<your press>, kv_budget={EVICTION_BUDGET}))"
    try:
        actual, trace = _evicting_run(llm, prompt)
    except NotImplementedError:
        return todo(name)
    except Exception as err:  # blocks_to_drop's ValueError for a score of the wrong shape lands here too
        return CheckResult("FAIL", name, f"raised {describe_exception(err)} inside the engine {engine}")
    for num_tokens, kept, dropped in trace:
        if dropped and kept and max(dropped) > min(kept):
            return CheckResult("FAIL", name, f"right on every case, but in the engine {engine}, after {num_tokens} "
                                             f"tokens it kept blocks at positions {kept} and dropped {dropped}: "
                                             "a newer block went before an older one")
    if actual != expected:
        first = next(i for i, (g, w) in enumerate(zip(actual, expected, strict=False)) if g != w)
        return CheckResult("FAIL", name, f"in the engine {engine} greedy token {first} differs: got {actual[first]}, "
                                         f"expected {expected[first]}", first_mismatch=first)
    return CheckResult("PASS", name, max_diff=0.0)


def check_recent_window_score(fn: Callable[[torch.Tensor, list[int], int], torch.Tensor]) -> CheckResult:
    """Check ``fn(keys, first_positions, num_tokens) -> scores`` by the blocks the engine drops, then in the engine.

    For every case and every number of blocks to drop (1 to all but one), the blocks
    :func:`minipd.kv.press.blocks_to_drop` picks with ``fn`` as the score must be those it picks with
    :func:`reference_recent_window_score` (only the order matters, not the score values). Then ``fn``
    is the press of an evicting ``tiny-py`` (``kv_budget=32``, a 30-token prompt, 40 greedy tokens):
    after every step the kept blocks must be the newest, and the tokens the reference press's.
    """
    name = "recent_window_score"
    reference_press, reader_press = RecentWindowPress(), RecentWindowPress(fn)
    for index, case in enumerate(_score_cases()):
        keys, positions, num_tokens = case.args
        where = f"[case: {case.label}]"
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        if not isinstance(actual, torch.Tensor):
            return report(CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected a torch.Tensor of "
                                                    f"shape ({len(positions)},) {where}"))
        if actual.shape != (len(positions),):
            return report(CheckResult("FAIL", name, f"returned shape {tuple(actual.shape)}, expected "
                                                    f"({len(positions)},): one score per block {where}"))
        for count in range(1, len(positions)):
            want = blocks_to_drop(reference_press, keys, positions, num_tokens, count)
            try:
                got = blocks_to_drop(reader_press, keys, positions, num_tokens, count)
            except Exception as err:  # e.g. a score of another shape on a second call
                return report(CheckResult("FAIL", name, f"raised {describe_exception(err)} {where}"))
            if got != want:
                message = (f"first mismatch in case {index} ({case.label}): dropping {count} of the blocks at "
                           f"positions {positions} drops those at {[positions[i] for i in got]}, expected "
                           f"{[positions[i] for i in want]}")
                return report(CheckResult("FAIL", name, message, first_mismatch=index))
    return report(_check_press_in_engine(name, fn))


# --- checking: compressed_transfer_bytes --------------------------------------------------------


def check_compressed_transfer_bytes(fn: Callable[..., int]) -> CheckResult:
    """Check ``fn(shape, prompt_len, kv_cache_dtype, block_size=16) -> bytes`` against
    :func:`reference_compressed_transfer_bytes`, and that an unknown ``kv_cache_dtype`` raises ``ValueError``."""
    name = "compressed_transfer_bytes"
    result = _check_numbers(name, fn, reference_compressed_transfer_bytes, _bytes_cases(), 0, int)
    if not result.passed:
        return report(result)
    case = Case("an unknown kv_cache_dtype", (TINY_PY, 16, "int4"))
    try:
        value = fn(*case.args)
    except ValueError:
        return report(result)
    except Exception as err:
        return report(CheckResult("FAIL", name, f"raised {describe_exception(err)}, expected a ValueError naming "
                                                f"the choices [case: {case.label}]"))
    return report(CheckResult("FAIL", name, f"returned {value!r}, expected a ValueError naming the choices "
                                            f"[case: {case.label}]"))
