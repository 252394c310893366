"""Chapter 07 exercises: mixture of experts — top-k routing, the sort-by-expert permutation, and how many
experts a decode step reads.

Each exercise has a reference solution (``reference_<name>``, written plainly so a stuck reader can
read it) and a checker (``check_<name>(fn)``) that runs the reader's function on fixed cases, edge
cases included, and prints PASS, FAIL (the largest difference and the first place the answers part)
or TODO. Two checkers then plug the reader's function into minipd itself and compare a greedy run of
the bundled ``tiny-py-moe`` model with the engine's own: ``check_route`` replaces every MoE layer's
router rule (:func:`minipd.moe.router.softmax_topk`), ``check_sort_by_expert`` builds the dispatcher
(:class:`minipd.moe.dispatch.LocalDispatcher`) from the reader's permutation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from minipd import LLM
from minipd.exercises.ch01 import compare_token_runs, greedy_tokens
from minipd.exercises.ch04 import _check_numbers
from minipd.exercises.checking import (
    Case,
    CheckResult,
    call_reader,
    describe_exception,
    report,
    shadowed,
    tensor_mismatch,
    todo,
)
from minipd.layers.moe import MoE
from minipd.moe.dispatch import LocalDispatcher, LocalExpertBatch
from minipd.moe.router import SoftmaxRouter

__all__ = [
    "ENGINE_PROMPTS",
    "ReaderDispatcher",
    "check_expected_experts_touched",
    "check_route",
    "check_sort_by_expert",
    "reader_routing",
    "reference_expected_experts_touched",
    "reference_route",
    "reference_sort_by_expert",
]

MODEL = "tiny-py-moe"
#: The prompts of the greedy engine runs: 24 tokens each.
ENGINE_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
                  "import os\n\n\ndef list_files(path):\n",
                  "class Stack:\n    def __init__(self):\n        self.items = []\n"]
ENGINE_TOKENS = 24


# --- reference solutions ------------------------------------------------------------------------


def reference_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing rule: softmax over every expert, keep the ``top_k`` largest, renormalise.

    ``logits`` (T, E) in any float dtype. The softmax runs in float32 (in bf16 two near-equal experts
    would tie and the choice would be arbitrary). The kept probabilities are divided by their sum, so
    each token's ``top_k`` weights add up to 1. Returns ``(weights, expert_ids)``, both (T, top_k):
    float32 weights and int64 ids (any order within a token: the layer sums over the slots).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), expert_ids


def reference_sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """The permutation that groups a batch's (token, slot) pairs by expert, its counts, and its inverse.

    ``expert_ids`` (T, k): the experts each token was routed to. Flatten it to ``T * k`` pairs (pair
    ``p`` is token ``p // k``, slot ``p % k``). Returns:

    - ``order`` (T*k,) int64: the pairs sorted by expert, so ``order[r]`` is the pair whose row is row
      ``r`` of the experts' input (expert 0's rows first, then expert 1's, ...). A stable sort keeps
      each expert's rows in token order, which is what minipd does (any order within an expert works);
    - ``counts`` (E,) int64: rows per expert (zero for an expert no token chose);
    - ``inverse`` (T*k,) int64: where each pair's row landed, ``inverse[order[r]] == r``; the combine
      gathers each pair's output back with it.
    """
    flat = expert_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return order, counts, inverse


def reference_expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts one MoE layer reads in a decode step of ``batch`` tokens.

    Assume each token picks ``top_k`` distinct experts uniformly at random, independently of the other
    tokens. One token leaves a given expert out with probability ``1 - top_k / num_experts``; all
    ``batch`` tokens leave it out with that probability to the power ``batch``. Summed over the experts:
    ``E * (1 - (1 - k / E) ** B)``. One token reads ``k`` experts; a large batch reads all ``E``.
    """
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


# --- cases --------------------------------------------------------------------------------------


def _route_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    spiky = torch.randn(6, 8, generator=gen)
    spiky[2, 5] = 80.0  # exp(80) overflows float32's 3.4e38 when computed without subtracting the max
    spiky[4] = -1e4 + 0.5 * torch.arange(8)  # every logit very negative: the softmax must still be well defined
    spiky[4, 1] = -9990.0
    return [
        Case("random logits, 16 tokens x 8 experts, top-2", (torch.randn(16, 8, generator=gen), 2)),
        Case("one token, top-1 (its weight is 1)", (torch.randn(1, 8, generator=gen), 1)),
        Case("huge and tiny logits", (spiky, 2)),
        Case("bfloat16 logits (weights must come out float32)", (torch.randn(9, 8, generator=gen).bfloat16(), 2)),
        Case("64 experts, top-8 (fine-grained, like Qwen3-MoE)", (3 * torch.randn(12, 64, generator=gen), 8)),
        Case("top_k equal to the number of experts", (torch.randn(5, 4, generator=gen), 4)),
        Case("no tokens at all", (torch.randn(0, 8, generator=gen), 2)),
    ]


def _distinct_ids(gen: torch.Generator, tokens: int, num_experts: int, k: int) -> torch.Tensor:
    """(tokens, k) distinct experts per token, drawn at random (what a router's top-k returns)."""
    return torch.rand(tokens, num_experts, generator=gen).topk(k, dim=-1).indices


def _sort_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1)
    skewed = _distinct_ids(gen, 20, 8, 2)
    skewed[:, 0] = 3  # a hot expert: every token's first choice
    skewed[:, 1] = torch.where(skewed[:, 1] == 3, 6, skewed[:, 1])
    return [
        Case("12 tokens, 8 experts, top-2", (_distinct_ids(gen, 12, 8, 2), 8)),
        Case("one token, top-2", (torch.tensor([[5, 1]]), 8)),
        Case("a hot expert and idle ones", (skewed, 8)),
        Case("experts 6 and 7 never chosen", (_distinct_ids(gen, 10, 6, 2), 8)),
        Case("40 tokens, 64 experts, top-8", (_distinct_ids(gen, 40, 64, 8), 64)),
        Case("top-1", (_distinct_ids(gen, 9, 4, 1), 4)),
    ]


def _touched_cases() -> list[Case]:
    cases = [Case("one token reads its top_k experts", (8, 2, 1)),
             Case("an empty batch reads nothing", (8, 2, 0)),
             Case("top_k = E: every expert, whatever the batch", (8, 8, 3)),
             Case("Mixtral-8x7B (8 experts, top-2) at batch 4", (8, 2, 4)),
             Case("Mixtral-8x7B at batch 64", (8, 2, 64))]
    for batch in (1, 8, 32, 128, 1024):
        cases.append(Case(f"DeepSeek-V3 (256 experts, top-8) at batch {batch}", (256, 8, batch)))
    cases.append(Case("Qwen3-30B-A3B (128 experts, top-8) at batch 16", (128, 8, 16)))
    return cases


# --- checking: route ----------------------------------------------------------------------------


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's slots sorted by expert id, so two answers that list the same experts in another order agree."""
    ids_sorted, perm = ids.sort(dim=-1)
    return weights.gather(-1, perm), ids_sorted


def _reader_router_forward(router: SoftmaxRouter, fn: Callable[..., Any], hidden: torch.Tensor) -> Any:
    # The engine's own logits (model dtype, quantized gate if asked), then the reader's rule.
    return fn(F.linear(hidden, router.gate_weight()), router.top_k)


@contextmanager
def reader_routing(llm: LLM, fn: Callable[[torch.Tensor, int], Any]) -> Iterator[None]:
    """Inside the block every MoE layer of ``llm`` routes with ``fn(logits, top_k)``; afterwards with its own rule."""
    routers = [layer.router for layer in llm.engine.core.moe_layers]
    if not all(isinstance(router, SoftmaxRouter) for router in routers):
        raise ValueError("reader_routing replaces softmax routers only")
    with contextlib.ExitStack() as stack:
        for router in routers:
            stack.enter_context(shadowed(router, forward=lambda hidden, router=router:
                                         _reader_router_forward(router, fn, hidden)))
        yield


def _engine_llm() -> LLM:
    # The loop backend on CPU: the plain reference path, the same answer on every machine.
    return LLM(MODEL, device="cpu", moe_backend="loop", enable_prefix_caching=False, num_kv_blocks=64)


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, ENGINE_PROMPTS, ENGINE_TOKENS)


def _compare_runs(name: str, actual: list[list[int]], expected: list[list[int]], engine: str) -> CheckResult:
    return compare_token_runs(name, actual, expected, f"right on every case, but plugged into the engine {engine}",
                              labels=[repr(p) for p in ENGINE_PROMPTS]) or CheckResult("PASS", name, max_diff=0.0)


def _check_route_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    llm = _engine_llm()
    expected = _greedy_tokens(llm)
    try:
        with reader_routing(llm, fn):
            actual = _greedy_tokens(llm)
    except NotImplementedError:
        return todo(name)
    except Exception as err:  # the reader's function broke inside the engine
        return CheckResult("FAIL", name, f"raised {describe_exception(err)} inside the engine "
                                         f"(LLM('{MODEL}') routing with your function)")
    return _compare_runs(name, actual, expected, f"(LLM('{MODEL}') routing with your function)")


def check_route(fn: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> CheckResult:
    """Check ``fn(logits, top_k) -> (weights, expert_ids)`` against :func:`reference_route`, then in the engine.

    Per token the same experts must be chosen (in any order) with the same weights (float32, within
    1e-5); ids must be int64. When every case does, ``fn`` routes every MoE layer of ``tiny-py-moe``
    for a greedy run (three prompts, 24 tokens each), which must give the engine's own tokens.
    """
    name = "route"
    worst = 0.0
    for case in _route_cases():
        expected_w, expected_ids = _by_expert(*reference_route(*case.args))
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        where = f"[case: {case.label}]"
        if not isinstance(actual, tuple | list) or len(actual) != 2:
            return report(CheckResult("FAIL", name, f"returned {type(actual).__name__}; expected a pair "
                                                    f"(weights, expert_ids) {where}"))
        weights, ids = actual
        # The ids first: the wrong experts make every weight wrong too, and are the thing to fix. Each
        # token's slots are put in expert order (on both sides) so any order within a token passes.
        if isinstance(ids, torch.Tensor) and ids.shape == expected_ids.shape and ids.dtype == expected_ids.dtype:
            if isinstance(weights, torch.Tensor) and weights.shape == ids.shape:
                weights, ids = _by_expert(weights, ids)
            else:
                ids = ids.sort(dim=-1).values
        failure, _ = tensor_mismatch(name, ids, expected_ids, 0.0, 0.0, where,
                                     subject="expert_ids (each token's, sorted):")
        if failure is not None:
            return report(failure)
        failure, diff = tensor_mismatch(name, weights, expected_w, 1e-5, 1e-5, where,
                                        subject="weights (slots sorted by expert):")
        if failure is not None:
            return report(failure)
        worst = max(worst, diff)
    result = _check_route_in_engine(name, fn)
    if result.passed:
        result = CheckResult("PASS", name, max_diff=worst)
    return report(result)


# --- checking: sort_by_expert -------------------------------------------------------------------


@dataclass
class _ReaderBatch(LocalExpertBatch):
    """A local batch that also carries the reader's inverse permutation."""

    inverse: torch.Tensor | None = None


class ReaderDispatcher(LocalDispatcher):
    """A local dispatcher built on ``fn(expert_ids, num_experts) -> (order, counts, inverse)``.

    Dispatch copies the rows in ``order``; combine *gathers* each (token, slot) pair's output at
    ``inverse`` (where :class:`LocalDispatcher` scatters by ``order``), then weights and sums the slots.
    """

    def __init__(self, num_experts: int, fn: Callable[[torch.Tensor, int], Any]) -> None:
        super().__init__(num_experts)
        self.fn = fn

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                 dropped: bool = False) -> _ReaderBatch:
        if dropped:
            raise ValueError("ReaderDispatcher does not skip slots over capacity")
        order, counts, inverse = self.fn(expert_ids.clone(), self.num_experts)
        rows = hidden.index_select(0, order // expert_ids.shape[-1])
        return _ReaderBatch(hidden=rows, counts=counts, order=order, weights=weights, inverse=inverse)

    def combine(self, expert_out: torch.Tensor, batch: LocalExpertBatch) -> torch.Tensor:
        assert isinstance(batch, _ReaderBatch) and batch.inverse is not None
        tokens, k = batch.weights.shape
        by_slot = expert_out.index_select(0, batch.inverse).view(tokens, k, expert_out.shape[-1])
        return (by_slot * batch.weights.to(expert_out.dtype).unsqueeze(-1)).sum(dim=1)


def _permutation_failure(name: str, actual: Any, expert_ids: torch.Tensor, num_experts: int,
                         where: str) -> CheckResult | None:
    """What is wrong with ``(order, counts, inverse)`` for ``expert_ids``, or None when it is a valid answer."""
    if not isinstance(actual, tuple | list) or len(actual) != 3:
        return CheckResult("FAIL", name, f"returned {type(actual).__name__}; expected a triple "
                                         f"(order, counts, inverse) {where}")
    order, counts, inverse = actual
    flat = expert_ids.reshape(-1)
    pairs = flat.numel()
    failure, _ = tensor_mismatch(name, counts, torch.bincount(flat, minlength=num_experts), 0, 0, where,
                                 subject="counts:")
    if failure is not None:
        return failure
    for what, value in (("order", order), ("inverse", inverse)):
        if not isinstance(value, torch.Tensor) or value.shape != (pairs,) or value.dtype != torch.int64:
            got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            return CheckResult("FAIL", name, f"{what}: got {got}, expected int64 of shape ({pairs},): one entry "
                                             f"per (token, slot) pair {where}")
    seen = torch.zeros(pairs, dtype=torch.bool)
    in_range = (order >= 0) & (order < pairs)
    if not bool(in_range.all()):
        r = int((~in_range).nonzero()[0])
        return CheckResult("FAIL", name, f"order[{r}] = {int(order[r])} is not a pair index (0..{pairs - 1}) {where}",
                           first_mismatch=r)
    seen[order] = True
    if not bool(seen.all()):
        missing = int((~seen).nonzero()[0])
        return CheckResult("FAIL", name, f"order is not a permutation: pair {missing} (token "
                                         f"{missing // expert_ids.shape[-1]}) never appears {where}")
    experts = flat[order]
    down = (experts[1:] < experts[:-1]).nonzero()
    if down.numel():
        r = int(down[0]) + 1
        return CheckResult("FAIL", name, f"order is not grouped by expert: row {r} (pair {int(order[r])}) is for "
                                         f"expert {int(experts[r])}, after a row for expert {int(experts[r - 1])} "
                                         f"{where}", first_mismatch=r)
    back = inverse[order]
    wrong = (back != torch.arange(pairs)).nonzero()
    if wrong.numel():
        r = int(wrong[0])
        return CheckResult("FAIL", name, f"inverse is not order's inverse: row {r} holds pair {int(order[r])}, but "
                                         f"inverse[{int(order[r])}] = {int(back[r])} {where}", first_mismatch=r)
    return None


def _check_sort_in_layer(name: str, fn: Callable[..., Any]) -> CheckResult | None:
    """A random MoE layer with the reader's dispatcher against the local one, on 37 tokens."""
    torch.manual_seed(0)
    layer = MoE(64, 48, 8, 2, implementation="loop").eval()
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = layer(hidden)
        layer.dispatcher = ReaderDispatcher(8, fn)
        try:
            actual = layer(hidden)
        except Exception as err:
            return CheckResult("FAIL", name, f"raised {describe_exception(err)} inside a MoE layer "
                                             "(8 experts, top-2, 37 tokens)")
    failure, _ = tensor_mismatch(name, actual, expected, 1e-5, 1e-5, "[a MoE layer: 8 experts, top-2, 37 tokens]",
                                 subject="layer output:")
    return failure


def _check_sort_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    llm = _engine_llm()
    expected = _greedy_tokens(llm)
    layers = llm.engine.core.moe_layers
    originals = [layer.dispatcher for layer in layers]
    engine = f"(LLM('{MODEL}') dispatching with your permutation)"
    try:
        for layer in layers:
            layer.dispatcher = ReaderDispatcher(layer.router.num_experts, fn)
        actual = _greedy_tokens(llm)
    except NotImplementedError:
        return todo(name)
    except Exception as err:
        return CheckResult("FAIL", name, f"raised {describe_exception(err)} inside the engine {engine}")
    finally:
        for layer, dispatcher in zip(layers, originals, strict=True):
            layer.dispatcher = dispatcher
    return _compare_runs(name, actual, expected, engine)


def check_sort_by_expert(fn: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                         ) -> CheckResult:
    """Check ``fn(expert_ids, num_experts) -> (order, counts, inverse)``, then run a MoE layer and the engine with it.

    On every case: ``counts`` must equal the rows per expert (int64, shape (E,)); ``order`` must be a
    permutation of the ``T*k`` pairs that lists them grouped by expert in increasing expert order (any
    order within an expert); ``inverse[order[r]]`` must be ``r``. Then a random MoE layer dispatching with
    ``fn`` must give the local dispatcher's output, and ``tiny-py-moe`` dispatching with it the engine's
    greedy tokens (three prompts, 24 tokens each).
    """
    name = "sort_by_expert"
    for case in _sort_cases():
        actual, failure = call_reader(name, fn, case)
        if failure is None:
            failure = _permutation_failure(name, actual, *case.args, where=f"[case: {case.label}]")
        if failure is not None:
            return report(failure)
    failure = _check_sort_in_layer(name, fn)
    if failure is not None:
        return report(failure)
    return report(_check_sort_in_engine(name, fn))


# --- checking: expected_experts_touched ---------------------------------------------------------


def check_expected_experts_touched(fn: Callable[[int, int, int], float]) -> CheckResult:
    """Check ``fn(num_experts, top_k, batch) -> expected distinct experts`` against
    :func:`reference_expected_experts_touched` (within 1e-6), then against a simulation of random routing."""
    name = "expected_experts_touched"
    result = _check_numbers(name, fn, reference_expected_experts_touched, _touched_cases(), 1e-6, (int, float))
    if not result.passed:
        return report(result)
    # 4000 simulated decode steps of 16 tokens, each picking 2 of 8 experts: the mean distinct count.
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(4000, 16, 8, generator=gen).topk(2, dim=-1).indices.reshape(4000, -1)
    simulated = torch.zeros(4000, 8).scatter_(1, ids, 1.0).sum(1).mean().item()
    try:
        value = float(fn(8, 2, 16))
    except Exception as err:  # pragma: no cover - the cases above already called fn(8, 2, ...)
        return report(CheckResult("FAIL", name, f"raised {describe_exception(err)}"))
    if abs(value - simulated) > 0.05:
        return report(CheckResult("FAIL", name, f"fn(8, 2, 16) = {value:.4f}, but 4000 simulated steps touch "
                                                f"{simulated:.4f} experts on average"))
    return report(result)
