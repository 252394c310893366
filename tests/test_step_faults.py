"""A fault at any stage of a step loses nothing: scheduling, the forward pass, sampling, the eviction
press, output processing and statistics each fail once mid-run, the error reaches the caller of
``Engine.step``, stepping on gives every request exactly the tokens, text and log-probabilities of a
clean run, and every block comes back. A fault that repeats ends only the request it belongs to.
"""

from __future__ import annotations

import contextlib

import pytest

from minipd import LLM, SamplingParams
from minipd.engine.output_processor import OutputProcessingError

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Tree:\n    def __init__(self):", "for i in range(10):"]


class Injected(RuntimeError):
    """The fault a test planted."""


@contextlib.contextmanager
def fail_once(obj: object, name: str, at_call: int):
    """Make ``obj.name`` raise :class:`Injected` on its ``at_call``-th call (counting from 1), once."""
    original = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise Injected(f"{name} failed on call {at_call}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    try:
        yield calls
    finally:
        if name in vars(obj):
            delattr(obj, name)  # an instance attribute: the class's method shows through again
        else:
            setattr(obj, name, original)


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=10 + i, max_tokens=60, ignore_eos=True, logprobs=2)


def run(llm: LLM, inject=None) -> tuple[list, int]:
    """Every prompt through ``Engine.add_request``/``step``, stepping on after each error; the outputs and
    how many errors reached the caller."""
    engine = llm.engine
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    states = [engine.processor.states[i] for i in ids]
    errors = 0
    with inject(engine) if inject is not None else contextlib.nullcontext():
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            try:
                engine.step()
            except (Injected, OutputProcessingError) as err:
                assert isinstance(err, Injected) or isinstance(next(iter(err.errors.values())), Injected)
                errors += 1
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0  # every block came back
    return [s.to_output() for s in states], errors


def same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)  # a recomputed step may round differently


OPTIONS = dict(max_num_batched_tokens=32, num_kv_blocks=64)  # chunked prefills, several steps each


@pytest.fixture(scope="module")
def clean():
    return run(LLM("tiny-py", **OPTIONS))[0]


STAGES = {
    # Half-way through scheduling: what was scheduled is rolled back.
    "scheduler": lambda e: fail_once(e.core.scheduler.block_manager, "allocate", 25),
    "forward pass": lambda e: fail_once(e.core.runner, "execute", 12),
    "sampler": lambda e: fail_once(e.core.runner, "_sample", 20),
    "statistics": lambda e: fail_once(e.core, "_routing_stats", 15),
    "output processing": lambda e: fail_once(e.processor, "_apply", 30),
}


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_of_a_step_loses_nothing(clean, stage):
    got, errors = run(LLM("tiny-py", **OPTIONS), STAGES[stage])
    assert errors == 1  # it reached the caller
    same(got, clean)


def test_a_failing_press_keeps_the_token_and_evicts_before_the_next_step():
    options = dict(OPTIONS, kv_eviction="knorm", kv_budget=32, block_size=16)
    clean, _ = run(LLM("tiny-py", **options))
    llm = LLM("tiny-py", **options)
    got, errors = run(llm, lambda e: fail_once(e.core.press, "score", 3))
    assert errors == 1
    assert sum(len(o.token_ids) for o in got) == 60 * len(PROMPTS)  # the token of the failed step was delivered
    same(got, clean)  # and eviction happened before the next step computed, as in the clean run
    assert llm.engine.core.num_evicted_blocks > 0


def test_an_output_that_fails_twice_ends_only_its_request(clean):
    llm = LLM("tiny-py", **OPTIONS)
    engine = llm.engine
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    states = [engine.processor.states[i] for i in ids]
    apply = engine.processor._apply
    victim = ids[1]

    def broken(state, out, now):
        if state.request_id == victim and len(state.token_ids) == 5:
            raise Injected("a detokeniser that cannot go on")
        return apply(state, out, now)

    engine.processor._apply = broken
    errors = 0
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except OutputProcessingError:
            errors += 1
    assert errors == 2  # once to be tried again, once for good
    outputs = [s.to_output() for s in states]
    assert outputs[1].finish_reason == "abort" and "cannot go on" in outputs[1].stop_reason
    assert outputs[1].token_ids == clean[1].token_ids[:5]
    same(outputs[:1] + outputs[2:], clean[:1] + clean[2:])  # the others did not notice
    assert engine.block_manager.num_used_blocks == 0
