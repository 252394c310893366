"""Chapter 04 checkers against planted bugs (the three states of every checker: test_exercise_states.py).

The references also agree with minipd itself: the toy scheduler with the engine's Scheduler, step
by step (tests/test_batching.py checks the step counts against real runs).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from minipd import SamplingParams
from minipd.engine.request import Request
from minipd.engine.scheduler import Scheduler
from minipd.exercises import ch04
from minipd.exercises.checking import CheckResult
from minipd.kv.block_manager import BlockManager


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch04, f"check_{name}")


def stub(*args: Any) -> Any:
    raise NotImplementedError


# --- planted bugs --------------------------------------------------------------------------------


def static_perfect_packing(output_lens: list[int], batch_size: int) -> int:
    """Forgets that a batch waits for its longest member: total tokens over the batch size."""
    return math.ceil(sum(output_lens) / batch_size)


def static_global_max(output_lens: list[int], batch_size: int) -> int:
    """Uses the longest output of all requests for every batch."""
    return math.ceil(len(output_lens) / batch_size) * max(output_lens)


def continuous_as_static(output_lens: list[int], max_seqs: int) -> int:
    """Refills only when the whole batch is done: that is static batching."""
    return ch04.reference_static_batch_steps(output_lens, max_seqs)


def continuous_average(output_lens: list[int], max_seqs: int) -> int:
    """Spreads the tokens evenly over the slots, ignoring that a request cannot be split."""
    return math.ceil(sum(output_lens) / max_seqs)


def waste_outputs_only(prompt_lens: list[int], output_lens: list[int], batch_size: int) -> float:
    """Counts only the decode padding, not the prompt padding."""
    return ch04.reference_padding_waste([1] * len(prompt_lens), output_lens, batch_size)


def waste_full_last_batch(prompt_lens: list[int], output_lens: list[int], batch_size: int) -> float:
    """Pads the last, partial batch to ``batch_size`` rows."""
    computed = useful = 0
    for start in range(0, len(prompt_lens), batch_size):
        p, o = prompt_lens[start:start + batch_size], output_lens[start:start + batch_size]
        computed += batch_size * (max(p) + max(o))
        useful += sum(p) + sum(o)
    return 1 - useful / computed


def schedule_prefill_first(running, waiting, budget, max_seqs):
    """Admits waiting requests before serving the running ones."""
    batch = ch04.reference_schedule_step([], waiting, budget, max_seqs - len(running))
    used = sum(n for _, n in batch)
    return batch + ch04.reference_schedule_step(running, [], budget - used, max_seqs)


def schedule_no_chunking(running, waiting, budget, max_seqs):
    """Admits a waiting request only if its whole prompt fits."""
    batch = ch04.reference_schedule_step(running, [], budget, max_seqs)
    budget -= sum(n for _, n in batch)
    num_running = len(running)
    for rid, n in waiting:
        if n > budget or num_running >= max_seqs:
            break
        batch.append((rid, n))
        budget -= n
        num_running += 1
    return batch


def schedule_ignoring_max_seqs(running, waiting, budget, max_seqs):
    return ch04.reference_schedule_step(running, waiting, budget, 10**6)


BUGS = [
    ("static_batch_steps", static_perfect_packing),
    ("static_batch_steps", static_global_max),
    ("continuous_batch_steps", continuous_as_static),
    ("continuous_batch_steps", continuous_average),
    ("padding_waste", waste_outputs_only),
    ("padding_waste", waste_full_last_batch),
    ("schedule_step", schedule_prefill_first),
    ("schedule_step", schedule_no_chunking),
    ("schedule_step", schedule_ignoring_max_seqs),
]


@pytest.mark.parametrize(("name", "bug"), BUGS, ids=[b.__name__ for _, b in BUGS])
def test_planted_bug_fails_with_where(name: str, bug: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL"
    assert result.max_diff is not None and result.max_diff > 0
    assert result.first_mismatch is not None
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {name}: max |diff|") and "first mismatch in case" in out


def test_fail_message_names_the_case_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    ch04.check_static_batch_steps(static_perfect_packing)
    out = capsys.readouterr().out.strip()
    assert out == ("FAIL static_batch_steps: max |diff| 11; first mismatch in case 0 "
                   "(8 requests, batches of 4): got 13, expected 19")


def test_schedule_fail_points_at_the_first_differing_entry(capsys: pytest.CaptureFixture[str]) -> None:
    result = ch04.check_schedule_step(schedule_no_chunking)
    assert result.first_mismatch == 3  # the chunk of the prompt that does not fit
    assert "at entry 3: got nothing, expected ('d', 13)" in capsys.readouterr().out


# --- the references agree with minipd ------------------------------------------------------------


def toy_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(request_id=rid, all_token_ids=list(range(1, prompt_len + 1)), num_prompt_tokens=prompt_len,
                   params=SamplingParams(max_tokens=max_tokens), seed=0, eos_token_ids=frozenset(),
                   max_model_len=10_000, arrival_time=0.0)


@pytest.mark.parametrize("seed", range(5))
def test_reference_schedule_step_makes_the_engine_schedulers_choices(seed: int) -> None:
    rng = random.Random(seed)
    budget, max_seqs = rng.choice([8, 16, 32]), rng.choice([2, 3, 8])
    scheduler = Scheduler(BlockManager(10_000, 16, enable_prefix_caching=False), budget, max_seqs)
    pending = [toy_request(f"q{i}", rng.randint(1, 40), rng.randint(1, 6)) for i in range(12)]
    arrivals = sorted(rng.randint(0, 15) for _ in pending)
    for step in range(200):
        for request, arrival in zip(pending, arrivals, strict=True):
            if arrival == step:
                scheduler.add(request)
        running = [(r.request_id, r.num_uncomputed_tokens) for r in scheduler.running]
        waiting = [(r.request_id, r.num_tokens) for r in scheduler.waiting]
        batch = scheduler.schedule()
        assert [(r.request_id, n) for r, n in batch.entries] == ch04.reference_schedule_step(
            running, waiting, budget, max_seqs), f"step {step}"
        scheduler.commit(batch)  # what the engine does after running the model
        for request, _ in batch.entries:
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(7)
                if request.is_finished:
                    scheduler.finish(request)
        if step > 15 and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()
