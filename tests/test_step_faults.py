"""A fault at any stage of a step loses nothing: scheduling, the forward pass, sampling, the eviction
press, output processing and statistics each fail once mid-run, the error reaches the caller (of
``Engine.step``, ``LLM.generate`` or a stream), going on gives every request exactly the tokens, text and
log-probabilities of a clean run, and every block comes back. A fault that repeats ends only the request
it belongs to, or (a press) only costs the eviction.
"""

from __future__ import annotations

import contextlib

import pytest

from minipd import LLM, SamplingParams
from minipd.engine.output_processor import OutputProcessingError, OutputProcessor
from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Tree:\n    def __init__(self):", "for i in range(10):"]


class Injected(RuntimeError):
    """The fault a test planted."""


@contextlib.contextmanager
def fail_at(obj: object, name: str, at_call: int, always: bool = False):
    """Make ``obj.name`` raise :class:`Injected` on its ``at_call``-th call (counting from 1): that call only, or
    with ``always`` that one and every one after."""
    original = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call or (always and calls[0] > at_call):
            raise Injected(f"{name} failed on call {calls[0]}")
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
    # Half of them score their prompts too: those are recomputed whole after a rollback (no prefix reuse).
    return SamplingParams(temperature=0.9, seed=10 + i, max_tokens=60, ignore_eos=True, logprobs=2,
                          prompt_logprobs=1 if i % 2 else None)


def planted(err: BaseException) -> bool:
    """Whether ``err`` is the planted fault (itself, or as the failed output of an OutputProcessingError)."""
    if isinstance(err, OutputProcessingError):
        return all(isinstance(e, Injected) for e in err.errors.values())
    return isinstance(err, Injected)


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
                assert planted(err)
                errors += 1
    check_drained(llm)
    return [s.to_output() for s in states], errors


def check_drained(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.core.requests and not engine.processor.states  # nothing left behind, either side
    assert engine.block_manager.num_used_blocks == 0  # every block came back


def same_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)  # a recomputed step may round differently


def same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert len(w.logprobs) == len(w.token_ids) == 60
        same_logprobs(g.logprobs, w.logprobs)
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
        else:
            assert len(w.prompt_logprobs) == len(w.prompt_token_ids)
            same_logprobs(g.prompt_logprobs, w.prompt_logprobs)


OPTIONS = dict(max_num_batched_tokens=32, num_kv_blocks=64)  # chunked prefills, several steps each
PRESS = dict(OPTIONS, kv_eviction="knorm", kv_budget=32, block_size=16)


@pytest.fixture(scope="module")
def clean():
    return run(LLM("tiny-py", **OPTIONS))[0]


STAGES = {
    "schedule": lambda e: fail_at(e.core.scheduler, "schedule", 14),
    # Half-way through scheduling: what was scheduled so far is rolled back.
    "scheduler allocation": lambda e: fail_at(e.core.scheduler.block_manager, "allocate", 25),
    "forward pass": lambda e: fail_at(e.core.runner, "execute", 12),
    # The last layer: every other layer has written this step's K/V already.
    "model layer": lambda e: fail_at(e.core.model.layers[-1], "forward", 16),
    "sampler": lambda e: fail_at(e.core.runner, "_sample", 20),
    "statistics": lambda e: fail_at(e.core, "_routing_stats", 15),
    "step record": lambda e: fail_at(e.core, "_record", 18),
    "output processing": lambda e: fail_at(e.processor, "_apply", 30),
}


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_of_a_step_loses_nothing(clean, stage):
    got, errors = run(LLM("tiny-py", **OPTIONS), STAGES[stage])
    assert errors == 1  # it reached the caller
    same(got, clean)


@pytest.mark.parametrize(("press", "granularity"), [("knorm", "block"), ("snapkv", "block"), ("knorm", "token")])
def test_a_failing_press_keeps_the_token_and_evicts_before_the_next_step(press, granularity):
    options = dict(PRESS, kv_eviction=press, kv_eviction_granularity=granularity)
    clean, _ = run(LLM("tiny-py", **options))
    llm = LLM("tiny-py", **options)
    got, errors = run(llm, lambda e: fail_at(e.core.press, "score", 3))
    assert errors == 1
    # The token of the step whose press failed was delivered (before the fix: 59 of 60 for each request).
    assert [len(o.token_ids) for o in got] == [60] * len(PROMPTS)
    same(got, clean)  # and eviction happened before the next step computed, as in the clean run
    assert llm.engine.core.num_evicted_blocks > 0


def test_a_press_that_keeps_failing_costs_the_eviction_only():
    """Retried once, then skipped every time: each step still runs and delivers, so the run is exactly one
    without eviction, with an error per step that tried to evict."""
    unpressed, _ = run(LLM("tiny-py", **{k: v for k, v in PRESS.items() if k not in ("kv_eviction", "kv_budget")}))
    llm = LLM("tiny-py", **PRESS)
    got, errors = run(llm, lambda e: fail_at(e.core.press, "score", 1, always=True))
    assert errors > 2
    same(got, unpressed)
    assert llm.engine.core.num_evicted_blocks == 0


@pytest.mark.parametrize("stage", ["forward pass", "sampler", "statistics", "output processing", "press"])
def test_generate_raises_frees_its_requests_and_a_second_call_gives_the_clean_outputs(clean, stage):
    if stage == "press":
        want, _ = run(LLM("tiny-py", **PRESS))
        llm, inject = LLM("tiny-py", **PRESS), lambda e: fail_at(e.core.press, "score", 3)
    else:
        want, llm, inject = clean, LLM("tiny-py", **OPTIONS), STAGES[stage]
    sampling = [params(i) for i in range(len(PROMPTS))]
    with inject(llm.engine):
        with pytest.raises((Injected, OutputProcessingError)) as err:
            llm.generate(PROMPTS, sampling)
        assert planted(err.value)
        check_drained(llm)  # what the failed call admitted was freed, on both sides
        got = llm.generate(PROMPTS, sampling)
    check_drained(llm)
    same(got, want)


@pytest.mark.parametrize("stage", ["forward pass", "model layer", "statistics", "output processing"])
def test_streams_go_on_after_an_error_with_every_delta(clean, stage):
    llm = LLM("tiny-py", **OPTIONS)
    streams = [llm.stream(p, params(i)) for i, p in enumerate(PROMPTS)]
    deltas: list[list] = [[] for _ in streams]
    errors = 0
    with STAGES[stage](llm.engine):
        while not all(d and d[-1].finished for d in deltas):
            for stream, got in zip(streams, deltas, strict=True):
                if got and got[-1].finished:
                    continue
                try:
                    got.append(next(stream))
                except (Injected, OutputProcessingError) as err:
                    assert planted(err)
                    errors += 1
    assert errors == 1
    for stream in streams:
        assert next(stream, None) is None  # ended after its last delta
    for got, want in zip(deltas, clean, strict=True):
        assert [d.token_id for d in got] == want.token_ids
        assert "".join(d.text for d in got) == want.text
        same_logprobs([d.logprobs for d in got], want.logprobs)
        same([got[-1].output], [want])
    check_drained(llm)


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
    check_drained(llm)


def test_outputs_behind_a_failed_one_wait_in_order():
    """Two outputs of one request in one call (as a client batching reports may send): the first fails, so the
    second waits behind it rather than being applied out of order, and the next call applies both."""
    llm = LLM("tiny-py", **OPTIONS)
    processor = OutputProcessor(llm.tokenizer)
    ids = llm.tokenizer.encode("def f(x):")
    state = processor.new_state("r", "def f(x):", ids, SamplingParams(max_tokens=3), 0.0)
    processor.add(state)
    tokens = llm.tokenizer.encode(" return x")[:3]
    apply, calls = processor._apply, [0]

    def once(state, out, now):
        calls[0] += 1
        if calls[0] == 1:
            raise Injected("once")
        return apply(state, out, now)

    processor._apply = once  # type: ignore[method-assign]
    first = EngineCoreOutputs([EngineCoreOutput("r", [tokens[0]]), EngineCoreOutput("r", [tokens[1]])], 1.0)
    with pytest.raises(OutputProcessingError) as err:
        processor.process(first)
    assert err.value.failed == [] and err.value.deltas == [] and state.token_ids == []
    assert processor.has_pending()
    last = EngineCoreOutputs([EngineCoreOutput("r", [tokens[2]], FinishReason.LENGTH)], 2.0)
    deltas, to_abort = processor.process(last)
    assert [d.token_id for d in deltas] == tokens and to_abort == []
    assert state.token_ids == tokens and state.finish_reason == "length"
    assert state.text == llm.tokenizer.decode(tokens) and not processor.has_pending()
