"""Chapter 06 checkers against planted bugs (the three states of every checker: test_exercise_states.py).

The references also agree with minipd itself: the int8 codes with ``minipd.kv.quant.FORMATS``, the
recent-window press with the sink-window press where there is no sink, and the bytes with the KV spec
of an engine and the K/V it exports. The int8 checker swaps the engine's format while it runs; every
test here checks that the swap is undone, whatever the reader's function did. No answer reaches the chapter
before its exercise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.exercises import ch06
from minipd.exercises.ch05 import MODEL_SHAPES, TINY_PY
from minipd.exercises.checking import TODO_MESSAGE, CheckResult
from minipd.kv.press import SinkWindowPress, blocks_to_drop
from minipd.kv.quant import FORMATS

NAMES = ["quantize_int8", "recent_window_score", "compressed_transfer_bytes"]
CHAPTER = Path(__file__).resolve().parent.parent / "chapters" / "06_kv_compression.ipynb"


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch06, f"check_{name}")


@pytest.fixture(autouse=True)
def formats_restored() -> Iterator[None]:
    """Every test leaves the engine's quantized formats as it found them (and puts them back if not)."""
    before = dict(FORMATS)
    yield
    after = dict(FORMATS)
    FORMATS.clear()
    FORMATS.update(before)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def stub(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes_and_stub_is_todo(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert checker(name)(getattr(ch06, f"reference_{name}")).passed
    assert capsys.readouterr().out.strip() == f"PASS {name}"
    assert checker(name)(stub).status == "TODO"
    assert capsys.readouterr().out.strip() == f"TODO {name}: {TODO_MESSAGE}"


# --- quantize_int8 -------------------------------------------------------------------------------


def quant_scale_over_128(x):
    """Divides by 128, the int8 range's other end, instead of 127."""
    xf = x.float()
    scales = (xf.abs().amax(-1) / 128).clamp_min(2.0**-24).half()
    return (xf / scales.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scales


def quant_scale_not_rounded_first(x):
    """Divides by the fp32 scale and stores it rounded to fp16 afterwards: the codes miss the stored scale."""
    xf = x.float()
    scales = (xf.abs().amax(-1) / 127).clamp_min(2.0**-24)
    return (xf / scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scales.half()


def quant_no_clamp(x):
    """No floor on the scale: an all-zero row gets scale 0 and codes 0/0."""
    xf = x.float()
    scales = (xf.abs().amax(-1) / 127).half()
    return (xf / scales.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scales


def quant_max_not_abs(x):
    """Takes the largest value rather than the largest magnitude."""
    xf = x.float()
    scales = (xf.amax(-1).clamp_min(0) / 127).clamp_min(2.0**-24).half()
    return (xf / scales.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scales


def quant_float_codes(x):
    """Right values, but the codes stay float32."""
    codes, scales = ch06.reference_quantize_int8(x)
    return codes.float(), scales


def quant_ternary(x):
    """Forgets the 127: codes are -1, 0 or 1 (wrong enough to change the engine's greedy tokens)."""
    xf = x.float()
    scales = xf.abs().amax(-1).clamp_min(2.0**-24).half()
    return (xf / scales.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scales


@pytest.mark.parametrize(("bug", "expected"), [
    (quant_scale_over_128, "scales: max |diff| "),
    (quant_scale_not_rounded_first, "codes: max |diff| 1;"),
    (quant_no_clamp, "scales: max |diff| 5.96e-08; first mismatch at index (1, 0): got 0, expected 5.96e-08 "
                     "[case: an all-zero row (token 1, head 0)]"),
    (quant_max_not_abs, "scales: max |diff| "),
    (quant_float_codes, "codes: dtype torch.float32, expected torch.int8"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_quantize_bugs_fail_with_where(bug: Callable[..., Any], expected: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    result = ch06.check_quantize_int8(bug)
    assert result.status == "FAIL"
    assert expected in capsys.readouterr().out
    if "dtype" not in expected:
        assert isinstance(result.first_mismatch, tuple) and result.max_diff is not None and result.max_diff > 0


def test_quantize_fail_points_at_the_first_differing_scale(capsys: pytest.CaptureFixture[str]) -> None:
    result = ch06.check_quantize_int8(quant_scale_over_128)
    assert result.first_mismatch == (0, 0)
    out = capsys.readouterr().out
    assert out.startswith("FAIL quantize_int8: scales: max |diff| ")
    assert "first mismatch at index (0, 0)" in out and "[case: random normal, 16 tokens x 2 KV heads x 32 dims]" in out


def test_the_engine_catches_what_the_cases_would_miss(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ch06, "_quantize_cases", list)  # no direct cases: only the engine run checks
    result = ch06.check_quantize_int8(quant_ternary)
    assert result.status == "FAIL" and isinstance(result.first_mismatch, int)
    out = capsys.readouterr().out
    assert "plugged into the engine (LLM('tiny-py', kv_cache_dtype='int8')) greedy token" in out
    assert repr(ch06.QUANT_PROMPTS[0]) in out
    assert ch06.check_quantize_int8(ch06.reference_quantize_int8).passed


def test_a_function_breaking_inside_the_engine_fails_and_the_format_comes_back(monkeypatch: pytest.MonkeyPatch,
                                                                               capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    monkeypatch.setattr(ch06, "_quantize_cases", list)
    original = FORMATS["int8"]
    result = ch06.check_quantize_int8(quant_float_codes)  # the pool's int8 codes cannot take float32
    assert result.status == "FAIL" and FORMATS["int8"] is original
    assert "inside the engine (LLM('tiny-py', kv_cache_dtype='int8'))" in capsys.readouterr().out

    class Interrupted(BaseException):
        pass

    def interrupted(x):
        raise Interrupted  # not even an Exception: the format must still be put back

    with pytest.raises(Interrupted):
        ch06.check_quantize_int8(interrupted)
    assert FORMATS["int8"] is original


def test_quantize_reference_is_the_engines_int8_format() -> None:
    gen = torch.Generator().manual_seed(5)
    inputs = [case.args[0] for case in ch06._quantize_cases()]
    inputs += [torch.randn(300, 8, 128, generator=gen) * 3, torch.randn(7, 4, 16, generator=gen).bfloat16()]
    for x in inputs:
        codes, scales = ch06.reference_quantize_int8(x)
        want_codes, want_scales = FORMATS["int8"].quantize(x)
        assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == x.shape[:-1]
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


# --- recent_window_score -------------------------------------------------------------------------


def score_oldest_kept(keys, first_positions, num_tokens):
    """Keeps the oldest blocks: drops the newest first."""
    return -torch.tensor(first_positions, dtype=torch.float32)


def score_with_sink(keys, first_positions, num_tokens):
    """The sink-window press: keeps block 0 as well."""
    return SinkWindowPress().score(keys, first_positions, num_tokens)


def score_by_key_norm(keys, first_positions, num_tokens):
    """Keeps blocks of small keys (knorm), not recent ones."""
    return -keys.float().norm(dim=-1).mean(dim=(1, 2, 3))


def score_column(keys, first_positions, num_tokens):
    """Right order, wrong shape: (blocks, 1)."""
    return torch.tensor(first_positions, dtype=torch.float32)[:, None]


@pytest.mark.parametrize(("bug", "expected"), [
    (score_oldest_kept, "first mismatch in case 0 (4 blocks from the start): dropping 1 of the blocks at positions "
                        "[0, 16, 32, 48] drops those at [48], expected [0]"),
    (score_with_sink, "first mismatch in case 0 (4 blocks from the start): dropping 1 of the blocks at positions "
                      "[0, 16, 32, 48] drops those at [16], expected [0]"),
    (score_by_key_norm, "first mismatch in case 0 (4 blocks from the start)"),
    (score_column, "returned shape (4, 1), expected (4,): one score per block [case: 4 blocks from the start]"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_press_bugs_fail_with_where(bug: Callable[..., Any], expected: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert ch06.check_recent_window_score(bug).status == "FAIL"
    out = capsys.readouterr().out
    assert out.startswith("FAIL recent_window_score: ") and expected in out


def test_press_bugs_fail_in_the_engine_too(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ch06, "_score_cases", list)  # no direct cases: only the engine run checks
    assert ch06.check_recent_window_score(ch06.reference_recent_window_score).passed
    capsys.readouterr()
    assert ch06.check_recent_window_score(score_oldest_kept).status == "FAIL"
    assert ("after 48 tokens it kept blocks at positions [0, 16] and dropped [32]: a newer block went before an "
            "older one") in capsys.readouterr().out
    assert ch06.check_recent_window_score(score_with_sink).status == "FAIL"
    assert "it kept blocks at positions [0, 32] and dropped [16]" in capsys.readouterr().out
    assert ch06.check_recent_window_score(lambda k, f, n: torch.zeros(1)).status == "FAIL"
    out = capsys.readouterr().out
    assert "raised ValueError: RecentWindowPress.score returned shape (1,), expected (3,)" in out
    assert "inside the engine (LLM('tiny-py', kv_eviction=<your press>, kv_budget=32))" in out


def test_recent_window_is_sink_window_without_a_sink() -> None:
    keys = torch.randn(4, 1, 16, 1, 8)
    for positions in ([16, 32, 48, 64], [32, 64, 80, 96]):
        for count in range(1, 4):
            assert (blocks_to_drop(ch06.RecentWindowPress(), keys, positions, 120, count)
                    == blocks_to_drop(SinkWindowPress(), keys, positions, 120, count) == list(range(count)))


def test_the_press_plugs_into_an_llm() -> None:
    llm = LLM("tiny-py", device="cpu", kv_eviction=ch06.RecentWindowPress(), kv_budget=32)
    out = llm.generate([list(range(1, 40))], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(out.token_ids) == 30 and llm.engine.core.num_evicted_blocks > 0


# --- compressed_transfer_bytes -------------------------------------------------------------------


def bytes_no_scales(shape, prompt_len, kv_cache_dtype, block_size=16):
    """Counts the values but not the 8-bit formats' scales."""
    tokens = -(-prompt_len // block_size) * block_size
    values_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    return tokens * values_per_token * ch06.VALUE_BYTES[kv_cache_dtype]


def bytes_exact_tokens(shape, prompt_len, kv_cache_dtype, block_size=16):
    """Counts the prompt's tokens, not the whole blocks that move."""
    return ch06.reference_compressed_transfer_bytes(shape, prompt_len, kv_cache_dtype, 1)


def bytes_one_scale_per_token(shape, prompt_len, kv_cache_dtype, block_size=16):
    """One scale per token and layer, not per KV head for K and for V."""
    total = ch06.reference_compressed_transfer_bytes(shape, prompt_len, kv_cache_dtype, block_size)
    if kv_cache_dtype in ("int8", "fp8"):
        tokens = -(-prompt_len // block_size) * block_size
        total -= tokens * shape["num_hidden_layers"] * 2 * (2 * shape["num_key_value_heads"] - 1)
    return total


def bytes_unknown_is_fp16(shape, prompt_len, kv_cache_dtype, block_size=16):
    """Right for the five dtypes, but anything else counts as 2 bytes instead of raising."""
    if kv_cache_dtype not in ch06.VALUE_BYTES:
        kv_cache_dtype = "fp16"
    return ch06.reference_compressed_transfer_bytes(shape, prompt_len, kv_cache_dtype, block_size)


@pytest.mark.parametrize(("bug", "expected"), [
    (bytes_no_scales, "first mismatch in case 3 (tiny-py, 1 token, fp8): got 12288, expected 13056"),
    (bytes_exact_tokens, "first mismatch in case 0 (tiny-py, 1 token, float32): got 3072, expected 49152"),
    (bytes_one_scale_per_token, "first mismatch in case 3 (tiny-py, 1 token, fp8)"),
    (bytes_unknown_is_fp16, "returned 24576, expected a ValueError naming the choices [case: an unknown "
                            "kv_cache_dtype]"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_bytes_bugs_fail_with_where(bug: Callable[..., Any], expected: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    result = ch06.check_compressed_transfer_bytes(bug)
    assert result.status == "FAIL"
    out = capsys.readouterr().out
    assert out.startswith("FAIL compressed_transfer_bytes: ") and expected in out
    if "ValueError" not in expected:
        assert out.startswith("FAIL compressed_transfer_bytes: max |diff| ") and result.first_mismatch is not None


def test_bytes_reference_refuses_unknown_dtypes() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'float32', 'fp16', 'bf16', 'fp8', 'int8', "
                                         r"got 'int4'"):
        ch06.reference_compressed_transfer_bytes(TINY_PY, 16, "int4")


def test_bytes_per_token_of_an_int8_llama() -> None:
    # Llama-3-8B: 32 layers x K and V x 8 heads x (128 one-byte codes + a 2-byte scale).
    assert ch06.reference_compressed_transfer_bytes(MODEL_SHAPES["Llama-3-8B"], 1, "int8", 1) == 32 * 2 * 8 * 130


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "fp16", "bf16", "fp8", "int8"])
def test_bytes_reference_is_what_the_engine_stores_and_exports(kv_cache_dtype: str) -> None:
    llm = LLM("tiny-py", device="cpu", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=32, enable_prefix_caching=False)
    shape = {k: getattr(llm.config, k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")}
    assert shape == TINY_PY
    spec = llm.engine.core.kv_spec
    for prompt_len in (1, 16, 17, 70):
        blocks = -(-prompt_len // spec.block_size)
        want = ch06.reference_compressed_transfer_bytes(shape, prompt_len, kv_cache_dtype, spec.block_size)
        assert spec.bytes_per_block * blocks == want
        # What a prefill worker hands over: the K/V (and scales) of the prompt's blocks.
        state = llm.engine.make_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1), hold_kv=True)
        llm.engine.add(state)
        while not state.finished:
            llm.engine.step()
        assert llm.engine.export_kv(state.request_id, prompt_len).nbytes == want
        assert llm.engine.release_kv(state.request_id)


@pytest.mark.parametrize("name", NAMES)
def test_no_answer_reaches_the_chapter_before_its_exercise(name: str) -> None:
    """No code cell before the checker's names the reference solution or imports the chapter's exercises."""
    cells = ["".join(c["source"]) for c in json.loads(CHAPTER.read_text())["cells"] if c["cell_type"] == "code"]
    checked = next(i for i, source in enumerate(cells) if f"check_{name}(" in source)
    for source in cells[:checked]:
        assert not re.search(rf"\breference_{name}\b|minipd\.exercises\.ch06\b", source), source
