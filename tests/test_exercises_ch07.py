"""Chapter 07 checkers against planted bugs (the three states of every checker, in one place here too).

The references also agree with minipd itself: the route with the engine's softmax router, the permutation
with the local dispatcher's, and the expected experts with :mod:`minipd.viz.moe`'s curve and the simulation
the chapter draws until the reader's formula passes. The checkers swap routers and dispatchers of a live
engine; every test here checks that the swap is undone. No answer reaches the chapter before its exercise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from minipd import LLM
from minipd.exercises import ch07
from minipd.exercises.checking import TODO_MESSAGE, CheckResult
from minipd.moe.dispatch import LocalDispatcher
from minipd.moe.router import SoftmaxRouter, softmax_topk
from minipd.viz import moe as viz

NAMES = ["route", "sort_by_expert", "expected_experts_touched"]
CHAPTER = Path(__file__).resolve().parent.parent / "chapters" / "07_moe.ipynb"


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch07, f"check_{name}")


def stub(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes_and_stub_is_todo(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert checker(name)(getattr(ch07, f"reference_{name}")).passed
    assert capsys.readouterr().out.strip() == f"PASS {name}"
    assert checker(name)(stub).status == "TODO"
    assert capsys.readouterr().out.strip() == f"TODO {name}: {TODO_MESSAGE}"


@pytest.mark.parametrize("bad", [lambda *a, **k: None, lambda *a, **k: 1 / 0, "not a function",
                                 lambda *a, **k: (torch.zeros(1), torch.zeros(1), torch.zeros(1))],
                         ids=["none", "zero-division", "not-callable", "junk-tensors"])
@pytest.mark.parametrize("name", NAMES)
def test_wrong_answers_fail_without_raising(name: str, bad: Any) -> None:
    result = checker(name)(bad)
    assert result.status == "FAIL" and result.message


# --- route ---------------------------------------------------------------------------------------


def route_no_renormalise(logits, top_k):
    """Keeps the probabilities of the full softmax."""
    return torch.softmax(logits.float(), -1).topk(top_k, dim=-1)


def route_smallest(logits, top_k):
    """Picks the least probable experts."""
    probs = torch.softmax(logits.float(), -1)
    weights, ids = probs.topk(top_k, dim=-1, largest=False)
    return weights / weights.sum(-1, keepdim=True), ids


def route_naive_exp(logits, top_k):
    """exp without subtracting the max: inf/inf on huge logits, 0/0 on very negative ones."""
    e = logits.float().exp()
    weights, ids = (e / e.sum(-1, keepdim=True)).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def route_int32_ids(logits, top_k):
    weights, ids = ch07.reference_route(logits, top_k)
    return weights, ids.int()


def route_input_dtype(logits, top_k):
    """Softmax in the logits' dtype: bf16 weights for bf16 logits."""
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def route_weights_only(logits, top_k):
    return ch07.reference_route(logits, top_k)[0]


@pytest.mark.parametrize(("bug", "expected"), [
    (route_no_renormalise, "weights (slots sorted by expert): max |diff|"),
    (route_smallest, "expert_ids (each token's, sorted): max |diff|"),
    (route_naive_exp, "[case: huge and tiny logits]"),
    (route_int32_ids, "dtype torch.int32, expected torch.int64"),
    (route_input_dtype, "dtype torch.bfloat16, expected torch.float32 [case: bfloat16 logits"),
    (route_weights_only, "expected a pair (weights, expert_ids)"),
])
def test_route_bugs_fail_with_where(bug: Callable[..., Any], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = ch07.check_route(bug)
    assert result.status == "FAIL"
    assert expected in result.message, result.message
    assert capsys.readouterr().out.startswith("FAIL route:")


def test_route_passes_in_any_slot_order_and_as_softmax_of_the_top_logits() -> None:
    def reversed_slots(logits, top_k):
        weights, ids = ch07.reference_route(logits, top_k)
        return weights.flip(-1), ids.flip(-1)

    def softmax_of_top_logits(logits, top_k):  # the same numbers, as HF's Mixtral computes them
        top, ids = logits.float().topk(top_k, dim=-1)
        return torch.softmax(top, -1), ids

    assert ch07.check_route(reversed_slots).passed
    assert ch07.check_route(softmax_of_top_logits).passed


def test_route_reference_is_the_engines_rule() -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    for k in (1, 2, 3):
        ours, theirs = ch07.reference_route(logits, k), softmax_topk(logits, k)
        torch.testing.assert_close(ours[0], theirs[0])
        assert torch.equal(ours[1], theirs[1])


def test_the_engine_catches_what_the_cases_would_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule right on small batches but wrong on long prompts passes the cases and fails in the engine."""
    def wrong_on_long_prompts(logits, top_k):
        weights, ids = ch07.reference_route(logits, top_k)
        return (weights.flip(-1), ids) if logits.shape[0] > 20 else (weights, ids)

    result = ch07.check_route(wrong_on_long_prompts)
    assert result.status == "FAIL" and "plugged into the engine" in result.message, result.message


def test_a_router_broken_in_the_engine_fails_and_the_routers_come_back() -> None:
    llm = LLM("tiny-py-moe", device="cpu", moe_backend="loop", num_kv_blocks=16)

    def breaks(logits, top_k):
        raise RuntimeError("broken")

    with pytest.raises(RuntimeError), ch07.reader_routing(llm, breaks):
        llm.generate(["def f():"], None, use_tqdm=False)
    assert all("forward" not in layer.router.__dict__ for layer in llm.engine.core.moe_layers)
    assert all(isinstance(layer.router, SoftmaxRouter) for layer in llm.engine.core.moe_layers)


# --- sort_by_expert ------------------------------------------------------------------------------


def sort_inverse_is_order(ids, num_experts):
    order, counts, _ = ch07.reference_sort_by_expert(ids, num_experts)
    return order, counts, order


def sort_counts_without_minlength(ids, num_experts):
    order, _, inverse = ch07.reference_sort_by_expert(ids, num_experts)
    return order, torch.bincount(ids.reshape(-1)), inverse


def sort_tokens_not_pairs(ids, num_experts):
    order, counts, inverse = ch07.reference_sort_by_expert(ids, num_experts)
    return order // ids.shape[-1], counts, inverse


def sort_descending(ids, num_experts):
    flat = ids.reshape(-1)
    order = (-flat).argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return order, torch.bincount(flat, minlength=num_experts), inverse


def sort_first_slot_only(ids, num_experts):
    """Sorts by each token's first expert: grouped wrong as soon as k > 1."""
    flat = ids[:, :1].expand_as(ids).reshape(-1)
    order = flat.argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return order, torch.bincount(ids.reshape(-1), minlength=num_experts), inverse


def sort_int32(ids, num_experts):
    order, counts, inverse = ch07.reference_sort_by_expert(ids, num_experts)
    return order.int(), counts, inverse


@pytest.mark.parametrize(("bug", "expected"), [
    (sort_inverse_is_order, "inverse is not order's inverse"),
    (sort_counts_without_minlength, "counts: shape"),
    (sort_tokens_not_pairs, "order is not a permutation"),
    (sort_descending, "order is not grouped by expert"),
    (sort_first_slot_only, "order is not grouped by expert"),
    (sort_int32, "order: got torch.int32"),
])
def test_sort_bugs_fail_with_where(bug: Callable[..., Any], expected: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    result = ch07.check_sort_by_expert(bug)
    assert result.status == "FAIL"
    assert expected in result.message, result.message
    assert capsys.readouterr().out.startswith("FAIL sort_by_expert:")


def test_any_order_within_an_expert_passes() -> None:
    def newest_first_within_expert(ids, num_experts):
        flat = ids.reshape(-1)
        # Sort by (expert, -pair): grouped by expert, each group in reverse token order.
        order = (flat * flat.numel() - torch.arange(flat.numel())).argsort()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return order, torch.bincount(flat, minlength=num_experts), inverse

    assert ch07.check_sort_by_expert(newest_first_within_expert).passed


def test_sort_reference_matches_the_local_dispatcher() -> None:
    ids = torch.rand(30, 8, generator=torch.Generator().manual_seed(2)).topk(2, dim=-1).indices
    hidden = torch.randn(30, 16)
    batch = LocalDispatcher(8).dispatch(hidden, torch.full((30, 2), 0.5), ids)
    order, counts, inverse = ch07.reference_sort_by_expert(ids, 8)
    assert torch.equal(order, batch.order) and torch.equal(counts, batch.counts)
    assert torch.equal(inverse[order], torch.arange(60))


def test_the_engines_dispatchers_come_back_after_a_failing_check() -> None:
    def breaks_on_long_prompts(ids, num_experts):
        if ids.shape[0] > 40:
            raise RuntimeError("broken")
        return ch07.reference_sort_by_expert(ids, num_experts)

    result = ch07.check_sort_by_expert(breaks_on_long_prompts)
    assert result.status == "FAIL" and "inside the engine" in result.message, result.message


# --- expected_experts_touched --------------------------------------------------------------------


@pytest.mark.parametrize(("bug", "expected"), [
    (lambda e, k, b: min(e, k * b), "first mismatch in case 3"),  # no collisions: an upper bound
    (lambda e, k, b: e * (1 - (1 - 1 / e) ** (k * b)), "first mismatch in case 0"),  # k picks with replacement
    (lambda e, k, b: k * b / e, "first mismatch in case 0"),
])
def test_touched_bugs_fail(bug: Callable[..., Any], expected: str) -> None:
    result = ch07.check_expected_experts_touched(bug)
    assert result.status == "FAIL" and expected in result.message, result.message


def test_touched_reference_is_the_viz_curve() -> None:
    for e, k, b in ((8, 2, 1), (256, 8, 64), (128, 8, 3)):
        assert ch07.reference_expected_experts_touched(e, k, b) == pytest.approx(viz.expected_experts_touched(e, k, b))


def test_the_simulation_the_chapter_draws_agrees_with_the_reference() -> None:
    for e, k, b in ((8, 2, 1), (8, 2, 4), (128, 8, 16), (256, 8, 64), (256, 8, 1024)):
        assert viz.simulated_experts_touched(e, k, b) == pytest.approx(ch07.reference_expected_experts_touched(e, k, b),
                                                                   abs=0.01 * e)
    assert viz.simulated_experts_touched(8, 2, 0) == 0
    # Drawn, not computed: another seed draws other steps, to the same count up to sampling noise.
    one, other = (viz.simulated_experts_touched(64, 8, 4, steps=400, seed=seed) for seed in (1, 2))
    assert one != other and one == pytest.approx(other, abs=0.5)


def test_the_figure_and_the_bytes_use_the_rule_they_are_given() -> None:
    seen = []

    def readers(e: int, k: int, b: int) -> float:
        seen.append((e, k, b))
        return ch07.reference_expected_experts_touched(e, k, b)

    models = [viz.moe_model(name) for name in viz.MOE_MODELS]
    axes = viz.plot_experts_touched(models, [1, 8, 64], measured={1: [2, 2]}, touched=readers,
                                    touched_label="your formula")
    assert (256, 8, 64) in seen and "your formula" in axes[0].get_title()
    assert models[2].decode_weight_bytes(8, touched=readers) == pytest.approx(models[2].decode_weight_bytes(8))
    every_expert = models[2].decode_weight_bytes(8, touched=lambda e, k, b: e)
    assert every_expert == pytest.approx(models[2].decode_weight_bytes(10**6))


@pytest.mark.parametrize("name", NAMES)
def test_no_answer_reaches_the_chapter_before_its_exercise(name: str) -> None:
    """No code cell before the checker's names the reference solution, or (for the experts touched) minipd's own
    copy of the formula: the chapter draws uniform routing by simulation until the reader's formula passes."""
    cells = ["".join(c["source"]) for c in json.loads(CHAPTER.read_text())["cells"] if c["cell_type"] == "code"]
    checked = next(i for i, source in enumerate(cells) if f"check_{name}(" in source)
    answers = [rf"\breference_{name}\b"] + [r"\bexpected_experts_touched\b"] * (name == "expected_experts_touched")
    for source in cells[:checked]:
        for answer in answers:
            assert not re.search(answer, source), f"{answer} before the {name} exercise:\n{source}"
