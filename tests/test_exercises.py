"""Chapter 01 checkers against planted bugs (the three states of every checker: test_exercise_states.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from minipd.exercises import ch01
from minipd.exercises.checking import Case, CheckResult, check_tensor_fn, compare_tensors
from minipd.kv import ContiguousKVCache


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch01, f"check_{name}")


def stub(*args: Any) -> Any:
    raise NotImplementedError


# --- planted bugs --------------------------------------------------------------------------------


def rms_norm_without_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 / x32.pow(2).mean(-1, keepdim=True).sqrt()).to(x.dtype)


def rms_norm_with_mean_not_mean_square(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 / (x32.mean(-1, keepdim=True).abs() + eps).sqrt()).to(x.dtype)


def rms_norm_without_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_wrong_sign(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((b, -a), dim=-1) * sin


def rope_interleaved_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # GPT-J layout: pairs are neighbouring channels, not channels half a head apart.
    a, b = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-b, a), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def mask_off_by_one(num_queries: int, num_keys: int) -> torch.Tensor:
    q_pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
    return torch.arange(num_keys)[None, :] < q_pos


def mask_queries_first(num_queries: int, num_keys: int) -> torch.Tensor:
    return torch.arange(num_keys)[None, :] <= torch.arange(num_queries)[:, None]


def mask_as_float(num_queries: int, num_keys: int) -> torch.Tensor:
    return ch01.reference_causal_mask(num_queries, num_keys).float()


def gqa_wrong_grouping(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    # `repeat` tiles heads (0,1,0,1,...) where query heads need (0,0,...,1,1,...).
    k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
    return ch01.reference_grouped_query_attention(q, k, v)


def gqa_mask_from_first_position(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    return torch.einsum("hts,shd->thd", scores.masked_fill(~mask, -math.inf).softmax(-1), v)


def gqa_unscaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return ch01.reference_grouped_query_attention(q * q.shape[-1] ** 0.5, k, v)


def top_p_drops_crossing_token(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = sorted_logits.softmax(-1).cumsum(-1) > top_p  # also drops the top token when it alone exceeds top_p
    return torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))


def top_p_returns_probs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return ch01.reference_top_p_filter(logits, top_p).softmax(-1)


def make_greedy(position_of: Callable[[ContiguousKVCache, int], int], use_cache: bool = True,
                include_prompt: bool = False, steps_delta: int = 0) -> Callable[..., list[int]]:
    """A greedy loop with a pluggable decode position, optionally without a cache or with other bugs."""

    def greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        cfg = model.config
        ids = list(prompt_ids)
        cache = ContiguousKVCache(cfg.num_hidden_layers, len(ids) + max_new_tokens, cfg.num_key_value_heads,
                                  cfg.head_dim)
        tokens, positions = torch.tensor(ids), torch.arange(len(ids))
        out: list[int] = []
        for _ in range(max_new_tokens + steps_delta):
            if use_cache:
                hidden = model(tokens, positions, cache)
            else:
                all_ids = ids + out
                hidden = model(torch.tensor(all_ids), torch.arange(len(all_ids)))
            out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
            tokens = torch.tensor(out[-1:])
            positions = torch.tensor([position_of(cache, len(ids))])
        return ids + out if include_prompt else out

    return greedy


PLANTED_BUGS = {
    "rms_norm": [rms_norm_without_eps, rms_norm_with_mean_not_mean_square, rms_norm_without_weight],
    "apply_rope": [rope_wrong_sign, rope_interleaved_pairs],
    "causal_mask": [mask_off_by_one, mask_queries_first, mask_as_float],
    "grouped_query_attention": [gqa_wrong_grouping, gqa_mask_from_first_position, gqa_unscaled],
    "top_p_filter": [top_p_drops_crossing_token, top_p_returns_probs],
    "greedy_generate": [
        make_greedy(lambda cache, n: 0),  # decode always at position 0
        make_greedy(lambda cache, n: n),  # decode always right after the prompt
        make_greedy(lambda cache, n: cache.length, use_cache=False),  # right tokens, no cache
        make_greedy(lambda cache, n: cache.length, include_prompt=True),
        make_greedy(lambda cache, n: cache.length, steps_delta=-1),
    ],
}


@pytest.mark.parametrize(("name", "bug"), [(n, b) for n, bugs in PLANTED_BUGS.items() for b in bugs],
                         ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", "bug"))
def test_planted_bug_fails(name: str, bug: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL", result
    assert capsys.readouterr().out.startswith(f"FAIL {name}: ")


def test_fail_reports_max_diff_and_first_index() -> None:
    result = ch01.check_rms_norm(rms_norm_without_weight)
    assert result.max_diff is not None and result.max_diff > 1e-3
    assert result.first_mismatch == (0, 0, 0)  # the first case has a unit weight, so the second one fails
    assert "max |diff|" in result.message and "first mismatch at index (0, 0, 0)" in result.message


def test_nan_from_missing_eps_is_an_infinite_diff() -> None:
    result = ch01.check_rms_norm(rms_norm_without_eps)
    assert result.max_diff == math.inf and "a row of zeros" in result.message


def test_greedy_fail_names_first_wrong_token() -> None:
    result = ch01.check_greedy_generate(make_greedy(lambda cache, n: 0))
    assert isinstance(result.first_mismatch, int) and f"new token {result.first_mismatch} differs" in result.message


def test_greedy_without_cache_is_told_why() -> None:
    result = ch01.check_greedy_generate(make_greedy(lambda cache, n: cache.length, use_cache=False))
    assert "right tokens" in result.message and "KV cache" in result.message


def test_greedy_without_cache_is_caught_with_keyword_arguments_too() -> None:
    def by_keyword(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            hidden = model(input_ids=torch.tensor(ids), positions=torch.arange(len(ids)))
            ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        return ids[len(prompt_ids):]

    assert "right tokens" in ch01.check_greedy_generate(by_keyword).message


def test_greedy_with_prompt_is_told_why() -> None:
    result = ch01.check_greedy_generate(make_greedy(lambda cache, n: cache.length, include_prompt=True))
    assert "return only the new tokens" in result.message


def test_correct_greedy_may_return_a_tensor() -> None:
    def as_tensor(model: Any, prompt_ids: list[int], max_new_tokens: int) -> torch.Tensor:
        return torch.tensor(ch01.reference_greedy_generate(model, prompt_ids, max_new_tokens))

    assert ch01.check_greedy_generate(as_tensor).passed


# --- the references themselves ------------------------------------------------------------------


def test_reference_greedy_matches_recomputing_without_cache() -> None:
    model = ch01.make_check_model()
    prompt = [3, 17, 42, 5, 8]
    cached = ch01.reference_greedy_generate(model, prompt, 12)
    assert make_greedy(lambda cache, n: 0, use_cache=False)(model, prompt, 12) == cached
    # The check model's logits are peaked, so float noise can never flip a greedy choice.
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt + cached), torch.arange(17)))
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3


def test_check_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = ch01.make_check_model(), ch01.make_check_model()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


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
