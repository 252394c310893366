"""Chapter 01 checkers against planted bugs (the three states of every checker: test_exercise_states.py),
and the seams they plug the reader's code into minipd with."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import minipd.layers.sampler as sampler_module
from minipd.exercises import ch01
from minipd.exercises.checking import Case, CheckResult, check_tensor_fn, compare_tensors
from minipd.kernels.backend import TORCH_BACKEND
from minipd.layers.attention import attention
from minipd.layers.rotary import apply_rotary

attention_module = importlib.import_module("minipd.kernels.attention")
ORIGINAL_MASK = attention_module.causal_mask


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch01, f"check_{name}")


# --- planted bugs --------------------------------------------------------------------------------


def rope_half_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's pairing (i, i + d/2) where the checkpoint is interleaved."""
    return apply_rotary(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))


def rope_wrong_sign(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turns every pair the other way."""
    return ch01.reference_apply_rope_interleaved(x, cos, -sin)


def rope_swapped_pair_roles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates (b, a) instead of (a, b): the pair's channels come out swapped."""
    out = ch01.reference_apply_rope_interleaved(x, cos, sin)
    return torch.stack((out[..., 1::2], out[..., 0::2]), dim=-1).flatten(-2)


def mask_one_too_wide(num_queries: int, num_keys: int, window: int) -> torch.Tensor:
    """Lets each query see window + 1 keys."""
    return ch01.reference_sliding_window_mask(num_queries, num_keys, window + 1)


def mask_causal_only(num_queries: int, num_keys: int, window: int) -> torch.Tensor:
    """Forgets the window."""
    return ch01.reference_sliding_window_mask(num_queries, num_keys, num_keys)


def mask_queries_first(num_queries: int, num_keys: int, window: int) -> torch.Tensor:
    """Places the queries at the first positions instead of the last."""
    q_pos = torch.arange(num_queries)[:, None]
    k_pos = torch.arange(num_keys)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def mask_as_float(num_queries: int, num_keys: int, window: int) -> torch.Tensor:
    return ch01.reference_sliding_window_mask(num_queries, num_keys, window).float()


def top_p_drops_crossing_token(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = sorted_logits.softmax(-1).cumsum(-1) > top_p  # also drops the top token when it alone exceeds top_p
    return torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))


def top_p_returns_probs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return ch01.reference_top_p_filter(logits, top_p).softmax(-1)


class CacheWithoutAdvance(ch01.ReferenceKVCache):
    """Never moves on: every pass overwrites position 0 onwards and forgets what came after."""

    def advance(self, num_tokens: int) -> None:
        pass


class CacheOfNothing(ch01.ReferenceKVCache):
    """Attends to this pass's own K/V only: right for a whole-prompt prefill, wrong from the first decode."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        return attention(q, k, v, scale, sliding_window)


class CacheAdvancingPerLayer(ch01.ReferenceKVCache):
    """Advances inside attend, so each layer writes at a different offset."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        out = super().attend(layer_idx, q, k, v, scale, sliding_window)
        self.length += k.shape[0]
        return out

    def advance(self, num_tokens: int) -> None:
        pass


class CacheWithTopLeftMask(ch01.ReferenceKVCache):
    """Masks as if the queries were the first positions: right for whole prompts and decodes (where
    torch's is_causal and no mask agree with the truth), wrong for a prefill chunk after cached tokens."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        end = self.length + k.shape[0]
        self.k[layer_idx, self.length:end], self.v[layer_idx, self.length:end] = k, v
        keys, values = self.k[layer_idx, :end], self.v[layer_idx, :end]
        q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=q.shape[0] > 1, scale=scale,
                                                               enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


PLANTED_BUGS = {
    "apply_rope_interleaved": [rope_half_layout, rope_wrong_sign, rope_swapped_pair_roles],
    "sliding_window_mask": [mask_one_too_wide, mask_causal_only, mask_queries_first, mask_as_float],
    "top_p_filter": [top_p_drops_crossing_token, top_p_returns_probs],
    "kv_cache": [CacheWithoutAdvance, CacheOfNothing, CacheAdvancingPerLayer, CacheWithTopLeftMask],
}


@pytest.mark.parametrize(("name", "bug"), [(n, b) for n, bugs in PLANTED_BUGS.items() for b in bugs],
                         ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", "bug"))
def test_planted_bug_fails(name: str, bug: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL", result
    assert capsys.readouterr().out.startswith(f"FAIL {name}: ")


def test_fail_reports_max_diff_and_first_index() -> None:
    result = ch01.check_sliding_window_mask(mask_one_too_wide)
    assert result.max_diff == 1.0 and result.first_mismatch == (3, 0)  # query 3 sees key 0: window 3 + 1
    assert "max |diff|" in result.message and "first mismatch at index (3, 0)" in result.message


# --- the engine stage: the reader's piece inside tiny-py ------------------------------------------


def test_engine_stage_of_rope_catches_the_layout_and_reports_logits() -> None:
    result = ch01._check_rope_in_engine("apply_rope_interleaved", rope_half_layout)
    assert result.status == "FAIL" and "logits: max |diff|" in result.message
    assert "interleaved layout" in result.message and result.first_mismatch == (1, 0)  # position 0: no rotation


def test_engine_stage_of_the_mask_catches_an_off_by_one() -> None:
    result = ch01._check_mask_in_engine("sliding_window_mask", mask_one_too_wide)
    assert result.status == "FAIL" and "logits:" in result.message and "sliding window" in result.message
    assert result.first_mismatch is not None and result.first_mismatch[0] == ch01.WINDOW  # first cut position
    assert attention_module.causal_mask is ORIGINAL_MASK


def test_engine_stage_names_a_bad_answer_from_inside_the_model() -> None:
    result = ch01._check_mask_in_engine("sliding_window_mask", lambda nq, nk, w: torch.ones(nq, nk))
    assert result.status == "FAIL" and "expected a torch.bool tensor" in result.message
    result = ch01._check_rope_in_engine("apply_rope_interleaved", lambda x, cos, sin: x[..., :4])
    assert result.status == "FAIL" and "expected the same shape and dtype" in result.message


def test_an_exception_in_the_engine_is_a_fail_and_everything_is_put_back() -> None:
    def rope_for_head_dim_16_only(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == 16, "only head_dim 16"
        return ch01.reference_apply_rope_interleaved(x, cos, sin)

    result = ch01._check_rope_in_engine("apply_rope_interleaved", rope_for_head_dim_16_only)
    assert result.status == "FAIL" and "AssertionError: only head_dim 16" in result.message
    assert "plugged into tiny-py" in result.message
    result = ch01._check_mask_in_engine("sliding_window_mask", lambda *a: 1 / 0)
    assert result.status == "FAIL" and "ZeroDivisionError" in result.message
    assert attention_module.causal_mask is ORIGINAL_MASK


def test_swapped_restores_the_attribute_when_the_block_raises() -> None:
    runner = ch01.engine_llm().engine.core.runner
    kernels = runner.kernels
    with pytest.raises(RuntimeError), ch01.swapped(runner, "kernels", None):
        assert runner.kernels is None
        raise RuntimeError("the reader's bug")
    assert runner.kernels is kernels


def test_model_seams_restore_the_model_bit_for_bit_even_when_the_block_raises() -> None:
    llm = ch01.engine_llm()
    model = llm.model
    ids = torch.tensor(llm.tokenizer.hf(ch01.ENGINE_PROMPTS[1])["input_ids"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logits = ch01._prefill_logits(model, ids)
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    with pytest.raises(RuntimeError), ch01.interleaved_checkpoint(model), ch01.sliding_windows(model, 3):
        assert not torch.equal(ch01._prefill_logits(model, ids), logits)
        raise RuntimeError("the reader's bug")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [layer.self_attn.sliding_window for layer in model.layers] == windows
    assert torch.equal(ch01._prefill_logits(model, ids), logits)  # packed copies of the weights rebuilt too


def test_interleaved_checkpoint_with_interleaved_rope_is_the_original_model() -> None:
    llm = ch01.engine_llm()
    model = llm.model
    ids = torch.tensor(llm.tokenizer.hf(ch01.ENGINE_PROMPTS[0])["input_ids"])
    logits = ch01._prefill_logits(model, ids)
    half = model.config.head_dim // 2
    with ch01.interleaved_checkpoint(model):
        assert (ch01._prefill_logits(model, ids) - logits).abs().max() > 1  # the plain rotation is now wrong
        reader = dataclasses.replace(TORCH_BACKEND, rotary=ch01._reader_rotary(ch01.reference_apply_rope_interleaved,
                                                                                half))
        assert torch.allclose(ch01._prefill_logits(model, ids, reader), logits, atol=1e-4)


def test_kv_cache_fail_names_the_step_and_the_case() -> None:
    result = ch01.check_kv_cache(CacheOfNothing)
    assert "logits after decode step 1" in result.message and "whole-prompt prefill" in result.message
    result = ch01.check_kv_cache(CacheWithTopLeftMask)
    assert "logits after the prefill" in result.message and "chunks of 4" in result.message
    result = ch01.check_kv_cache(lambda *a: None)
    assert result.status == "FAIL" and "gave a NoneType, which has no attend and advance" in result.message


def test_kv_cache_stub_class_is_todo() -> None:
    class Stub:
        def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int) -> None:
            pass

        def attend(self, *args: Any) -> torch.Tensor:
            raise NotImplementedError

        def advance(self, num_tokens: int) -> None:
            raise NotImplementedError

    assert ch01.check_kv_cache(Stub).status == "TODO"


def test_reference_kv_cache_tokens_are_the_engine_tokens() -> None:
    llm = ch01.engine_llm()
    cfg = llm.config
    ids = torch.tensor(llm.tokenizer.hf(ch01.ENGINE_PROMPTS[2])["input_ids"])
    cache = ch01.ReferenceKVCache(cfg.num_hidden_layers, len(ids) + 8, cfg.num_key_value_heads, cfg.head_dim)
    tokens, _ = ch01._greedy_with_cache(llm.model, ids, 8, cache, chunk=5)
    assert tokens == ch01.greedy_tokens(llm, [ch01.ENGINE_PROMPTS[2]], 8)[0]
    assert cache.length == len(ids) + 7  # the last token is sampled, never fed back


# --- the generic machinery ----------------------------------------------------------------------


def test_check_result_str() -> None:
    assert str(CheckResult("PASS", "f")) == "PASS f"
    assert str(CheckResult("TODO", "f", "the stub still raises NotImplementedError")).startswith("TODO f: ")


def test_compare_tensors_treats_equal_infinities_as_equal() -> None:
    inf = math.inf
    ok, max_diff, first = compare_tensors(torch.tensor([-inf, 1.0]), torch.tensor([-inf, 1.0]), 1e-6, 0)
    assert ok and max_diff == 0.0 and first is None
    ok, max_diff, first = compare_tensors(torch.tensor([0.0, -inf]), torch.tensor([-inf, 1.0]), 1e-6, 0)
    assert not ok and max_diff == inf and first == (0,)
    ok, _, first = compare_tensors(torch.tensor([[1.0, math.nan]]), torch.tensor([[1.0, 2.0]]), 1e-6, 0)
    assert not ok and first == (0, 1)


def test_reader_that_mutates_inputs_cannot_corrupt_the_reference() -> None:
    def in_place(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x / 2

    def cases(g: torch.Generator) -> list[Case]:
        return [Case("a vector", (torch.randn(5, generator=g),))]

    assert check_tensor_fn("copy", in_place, lambda x: x.clone(), cases).passed


def test_dtype_and_type_mismatches_fail() -> None:
    def cases(g: torch.Generator) -> list[Case]:
        return [Case("a vector", (torch.randn(4, generator=g),))]

    assert "dtype" in check_tensor_fn("f", lambda x: x.double(), torch.clone, cases).message
    assert "expected a torch.Tensor" in check_tensor_fn("f", lambda x: x.tolist(), torch.clone, cases).message


def test_broken_case_builder_fails_without_raising() -> None:
    def cases(g: torch.Generator) -> list[Case]:
        raise RuntimeError("bad checker")

    assert check_tensor_fn("f", torch.clone, torch.clone, cases).status == "FAIL"


def test_engine_stage_of_top_p_samples_with_the_reader_filter_and_puts_the_sampler_back() -> None:
    original = sampler_module.top_k_top_p_filter
    result = ch01._check_top_p_in_engine("top_p_filter", lambda logits, top_p: logits)  # no filtering at all
    assert result.status == "FAIL" and "sampled token" in result.message and "sampler" in result.message
    result = ch01._check_top_p_in_engine("top_p_filter", lambda logits, top_p: logits[:3])
    assert result.status == "FAIL" and "expected the same shape" in result.message
    result = ch01._check_top_p_in_engine("top_p_filter", lambda logits, top_p: 1 / 0)
    assert result.status == "FAIL" and "ZeroDivisionError" in result.message
    assert sampler_module.top_k_top_p_filter is original
