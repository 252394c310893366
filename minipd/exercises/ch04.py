"""Chapter 04 exercises: counting the steps of static and continuous batching, padding waste, and
one step of a token-budget scheduler.

Each exercise has a reference solution (``reference_<name>``, written plainly so a stuck reader can
read it) and a checker (``check_<name>(fn)``) that runs the reader's function on fixed cases,
edge cases included, and prints PASS, FAIL (the largest difference and the first case that
differs) or TODO. The step counts follow minipd's engine: a request's prefill step also produces
its first token, so a request asking for ``n`` tokens occupies a slot for exactly ``n`` steps, and
``reference_schedule_step`` makes the same choices as :class:`minipd.engine.scheduler.Scheduler`
(decode-first) when the KV pool has room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minipd.exercises.checking import Case, CheckResult, call_reader, report

__all__ = [
    "check_continuous_batch_steps",
    "check_padding_waste",
    "check_schedule_step",
    "check_static_batch_steps",
    "reference_continuous_batch_steps",
    "reference_padding_waste",
    "reference_schedule_step",
    "reference_static_batch_steps",
]


# --- reference solutions ------------------------------------------------------------------------


def reference_static_batch_steps(output_lens: list[int], batch_size: int) -> int:
    """Steps a static batcher needs for requests (in this order) all waiting at step 0.

    Requests go in batches of ``batch_size`` (the last may be smaller); a batch runs one step per
    token of its *longest* member, and the next batch starts only when it is done.
    """
    steps = 0
    for start in range(0, len(output_lens), batch_size):
        steps += max(output_lens[start:start + batch_size])
    return steps


def reference_continuous_batch_steps(output_lens: list[int], max_seqs: int) -> int:
    """Steps a continuous batcher needs, with at most ``max_seqs`` requests running at once.

    A request occupies a slot for exactly its output length in steps; when one finishes, the next
    waiting request (in order) takes the slot at the very next step. The token budget is assumed
    large enough never to bind.
    """
    slots_free_at = [0] * max_seqs  # the step at which each slot is next free
    for n in output_lens:
        slot = min(range(max_seqs), key=lambda s: slots_free_at[s])  # the earliest free slot
        slots_free_at[slot] += n
    return max(slots_free_at)


def reference_padding_waste(prompt_lens: list[int], output_lens: list[int], batch_size: int) -> float:
    """Fraction of the token slots a padded static batcher computes that are padding.

    Each batch (of ``batch_size`` requests in order; the last may be smaller) pads every prompt to
    the batch's longest prompt and keeps every row going until its longest output is done, so it
    computes ``rows * (longest prompt + longest output)`` token slots, of which only
    ``prompt + output`` per row are useful.
    """
    computed = useful = 0
    for start in range(0, len(prompt_lens), batch_size):
        prompts = prompt_lens[start:start + batch_size]
        outputs = output_lens[start:start + batch_size]
        computed += len(prompts) * (max(prompts) + max(outputs))
        useful += sum(prompts) + sum(outputs)
    return 1 - useful / computed


def reference_schedule_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]], budget: int,
                            max_seqs: int) -> list[tuple[str, int]]:
    """One step of a decode-first token-budget scheduler: which requests run, and how many tokens each.

    ``running`` lists ``(request_id, tokens_left)`` in admission order: 1 for a request that is
    decoding, more for one whose prompt is still being prefilled in chunks. ``waiting`` lists
    ``(request_id, prompt_len)`` in arrival order. Running requests are served first, in order,
    each taking what it needs or what is left of ``budget``; then waiting requests are admitted,
    in order, while budget is left and fewer than ``max_seqs`` requests run. A request that does
    not fit takes a chunk. Returns ``(request_id, tokens)`` pairs in the order they were scheduled.
    """
    batch = []
    for request_id, left in running:
        if budget == 0:
            break
        n = min(left, budget)
        batch.append((request_id, n))
        budget -= n
    num_running = len(running)
    for request_id, prompt_len in waiting:
        if budget == 0 or num_running >= max_seqs:
            break
        n = min(prompt_len, budget)
        batch.append((request_id, n))
        budget -= n
        num_running += 1
    return batch


# --- cases --------------------------------------------------------------------------------------

# Output lengths used by several cases: mixed, as in a real workload.
MIXED = [4, 10, 8, 7, 9, 2, 9, 2]


def _static_cases() -> list[Case]:
    return [
        Case("8 requests, batches of 4", (MIXED, 4)),
        Case("batch size 1: one request at a time", (MIXED, 1)),
        Case("one batch holds everything", (MIXED, 8)),
        Case("last batch is partial (8 requests, batches of 3)", (MIXED, 3)),
        Case("equal lengths", ([5, 5, 5, 5], 2)),
        Case("a single request", ([7], 4)),
    ]


def _continuous_cases() -> list[Case]:
    return [
        Case("8 requests, 4 slots", (MIXED, 4)),
        Case("1 slot: one request at a time", (MIXED, 1)),
        Case("more slots than requests", (MIXED, 16)),
        Case("a long request first, 2 slots", ([20, 1, 1, 1, 1, 1], 2)),
        Case("3 slots, last ones short", ([6, 6, 6, 6, 1, 1], 3)),
        Case("a single request", ([7], 4)),
    ]


def _padding_cases() -> list[Case]:
    prompts = [12, 20, 11, 14, 15, 17, 17, 13]
    return [
        Case("8 requests, batches of 4", (prompts, MIXED, 4)),
        Case("batch size 1: no padding at all", (prompts, MIXED, 1)),
        Case("last batch is partial (batches of 3)", (prompts, MIXED, 3)),
        Case("equal lengths: no waste", ([8, 8, 8], [5, 5, 5], 3)),
        Case("one long prompt among short ones", ([100, 2, 2, 2], [4, 4, 4, 4], 4)),
        Case("one long output among short ones", ([4, 4, 4, 4], [1, 1, 1, 30], 4)),
    ]


def _schedule_cases() -> list[Case]:
    decodes = [("a", 1), ("b", 1), ("c", 1)]
    return [
        Case("decodes only", (decodes, [], 16, 8)),
        Case("decodes, then a new prompt that fits", (decodes, [("d", 5)], 16, 8)),
        Case("a new prompt larger than what is left: it gets a chunk", (decodes, [("d", 40)], 16, 8)),
        Case("several new prompts, budget runs out on the third", (decodes, [("d", 5), ("e", 6), ("f", 9)], 16, 8)),
        Case("max_seqs reached: nobody is admitted", (decodes, [("d", 2)], 16, 3)),
        Case("max_seqs lets in only one more", (decodes, [("d", 2), ("e", 2)], 16, 4)),
        Case("a running prefill takes its next chunk", ([("a", 1), ("p", 30), ("b", 1)], [("d", 4)], 16, 8)),
        Case("budget used up by running requests", ([("a", 1), ("p", 30), ("b", 1)], [("d", 4)], 8, 8)),
        Case("nothing running: the first prompt is chunked", ([], [("d", 50), ("e", 3)], 32, 8)),
        Case("budget exactly used: the next prompt waits", ([("a", 1)], [("d", 15), ("e", 3)], 16, 8)),
        Case("nothing at all", ([], [], 16, 8)),
    ]


# --- checking -----------------------------------------------------------------------------------


def _as_pairs(value: Any) -> list[tuple[str, int]]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"returned {type(value).__name__}; expected a list of (request_id, tokens) pairs")
    pairs = []
    for item in value:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise TypeError(f"returned an entry {item!r}; expected (request_id, tokens) pairs")
        pairs.append((item[0], item[1]))
    return pairs


def _check_numbers(name: str, fn: Callable[..., Any], reference: Callable[..., Any], cases: list[Case],
                   tol: float, kind: type | tuple[type, ...]) -> CheckResult:
    """Numbers compared within ``tol``; the largest difference over all cases, the first failing case."""
    worst = 0.0
    first: tuple[int, str, Any, Any] | None = None
    for index, case in enumerate(cases):
        expected = reference(*case.args)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return failure
        if isinstance(actual, bool) or not isinstance(actual, kind):
            wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected {wanted} "
                                             f"[case: {case.label}]")
        diff = abs(float(actual) - float(expected))
        if diff != diff:  # NaN
            diff = float("inf")
        worst = max(worst, diff)
        if diff > tol and first is None:
            first = (index, case.label, actual, expected)
    if first is None:
        return CheckResult("PASS", name, max_diff=worst)
    index, label, actual, expected = first
    return CheckResult("FAIL", name, f"max |diff| {worst:.4g}; first mismatch in case {index} ({label}): "
                                     f"got {actual!r}, expected {expected!r}", max_diff=worst, first_mismatch=index)


def check_static_batch_steps(fn: Callable[[list[int], int], int]) -> CheckResult:
    """Check ``fn(output_lens, batch_size) -> steps`` against :func:`reference_static_batch_steps`."""
    return report(_check_numbers("static_batch_steps", fn, reference_static_batch_steps, _static_cases(), 0, int))


def check_continuous_batch_steps(fn: Callable[[list[int], int], int]) -> CheckResult:
    """Check ``fn(output_lens, max_seqs) -> steps`` against :func:`reference_continuous_batch_steps`."""
    return report(_check_numbers("continuous_batch_steps", fn, reference_continuous_batch_steps,
                                 _continuous_cases(), 0, int))


def check_padding_waste(fn: Callable[[list[int], list[int], int], float]) -> CheckResult:
    """Check ``fn(prompt_lens, output_lens, batch_size) -> fraction`` against :func:`reference_padding_waste`."""
    return report(_check_numbers("padding_waste", fn, reference_padding_waste, _padding_cases(), 1e-9,
                                 (int, float)))


def check_schedule_step(fn: Callable[..., list[tuple[str, int]]]) -> CheckResult:
    """Check ``fn(running, waiting, budget, max_seqs) -> [(request_id, tokens), ...]`` entry by entry."""
    name = "schedule_step"
    cases = _schedule_cases()
    for index, case in enumerate(cases):
        expected = reference_schedule_step(*case.args)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        try:
            got = _as_pairs(actual)
        except TypeError as err:
            return report(CheckResult("FAIL", name, f"{err} [case: {case.label}]"))
        if got == expected:
            continue
        pairs = zip(got, expected, strict=False)
        where = next((i for i, (g, e) in enumerate(pairs) if g != e), min(len(got), len(expected)))
        got_item = repr(got[where]) if where < len(got) else "nothing"
        want_item = repr(expected[where]) if where < len(expected) else "nothing"
        # Token counts compare as numbers; an entry for the wrong request counts as a whole mismatch.
        diffs = [abs(g[1] - e[1]) if g[0] == e[0] and isinstance(g[1], int | float) else float("inf")
                 for g, e in zip(got, expected, strict=False)]
        max_diff = max(diffs + ([float("inf")] if len(got) != len(expected) else []), default=0.0)
        message = (f"max |diff| {max_diff:.4g}; first mismatch in case {index} ({case.label}) at entry {where}: "
                   f"got {got_item}, expected {want_item}; whole answer {got}, expected {expected}")
        return report(CheckResult("FAIL", name, message, max_diff=max_diff, first_mismatch=where))
    return report(CheckResult("PASS", name, max_diff=0.0))
