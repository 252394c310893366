"""``AsyncLLM``: many requests in flight from asyncio, over the colocated and the disaggregated engine.

200 concurrent requests, 50 of them given up at random points (their task cancelled, or their
generator closed): every survivor equals offline greedy ``LLM.generate``, every given-up request stops
within two engine steps, blocks come back, and the event loop is never held up (a lag probe's P99, less the
time its thread waited for a core, stays under 20 ms). Deltas carry their token's log-probabilities; bad
input and a shut-down engine are refused.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from pd_helpers import needs_nixl, wait_until_blocks_free
from serve_helpers import LoopLagProbe, keep_states

from minipd import LLM, AsyncLLM, DisaggregatedLLM, SamplingParams
from minipd.errors import ParameterError

N, CANCELLED = 200, 50


def workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    text = ("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser()\n"
            "    args = parser.parse_args(argv)\n    return run(args)\n") * 6
    ids = llm.tokenizer.encode(text)
    prompts = [ids[(i * 7) % 60:(i * 7) % 60 + 3 + (i * 13) % 50] for i in range(N)]
    params = [SamplingParams(temperature=0, max_tokens=8 + (i * 5) % 24, ignore_eos=True) for i in range(N)]
    return prompts, params


@pytest.fixture(scope="module")
def reference() -> tuple[LLM, list, list, list[list[int]]]:
    llm = LLM("tiny-py", num_kv_blocks=1024)
    prompts, params = workload(llm)
    return llm, prompts, params, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


async def storm(engine: AsyncLLM, prompts, params, states: dict) -> dict:
    """Every request at once; ``CANCELLED`` of them (chosen at random) given up at random points."""
    rng = random.Random(0)
    doomed = set(rng.sample(range(N), CANCELLED))
    tokens: dict[int, list[int]] = {}
    at_cancel: dict[int, tuple[object, int]] = {}
    probe = LoopLagProbe()

    to_cancel: asyncio.Queue = asyncio.Queue()

    async def consume(i: int, stop_after: int | None, close: bool) -> None:
        got = tokens.setdefault(i, [])
        stream = engine.generate(prompts[i], params[i], request_id=f"r{i}")
        async for delta in stream:
            got.append(delta.token_id)
            if stop_after is not None and len(got) == stop_after:
                if close:  # the consumer closes the generator
                    state = states[f"r{i}"]
                    at_cancel[i] = (state, len(state.token_ids))
                    await stream.aclose()
                    return
                to_cancel.put_nowait(i)  # ... or its task is cancelled while it waits for the next delta

    async def canceller() -> None:
        while True:
            i = await to_cancel.get()
            state = states[f"r{i}"]
            at_cancel[i] = (state, len(state.token_ids))
            tasks[i].cancel()

    probing = asyncio.create_task(probe.run())
    cancelling = asyncio.create_task(canceller())
    tasks: dict[int, asyncio.Task] = {}
    for i in range(N):
        stop_after = rng.randint(1, params[i].max_tokens - 4) if i in doomed else None
        tasks[i] = asyncio.create_task(consume(i, stop_after, close=i % 2 == 0))
    await asyncio.wait(tasks.values(), timeout=120)
    probe.running = False
    cancelling.cancel()
    await probing
    assert all(t.done() for t in tasks.values()), "requests still running after 120 s"
    return {"tokens": tokens, "doomed": doomed, "at_cancel": at_cancel, "probe": probe}


def check(result: dict, expected: list[list[int]]) -> None:
    for i, got in result["tokens"].items():
        if i not in result["doomed"]:
            assert got == expected[i], f"request {i}"
    assert set(result["at_cancel"]) == result["doomed"]
    for state, tokens_then in result["at_cancel"].values():
        assert state.finish_reason == "abort" or len(state.token_ids) == state.params.max_tokens
        assert len(state.token_ids) - tokens_then <= 2  # stopped within two engine steps
    assert sum(state.finish_reason == "abort" for state, _ in result["at_cancel"].values()) >= CANCELLED - 5
    result["probe"].check(0.020)


def test_a_cancellation_storm_over_the_colocated_engine(reference):
    _, prompts, params, expected = reference
    llm = LLM("tiny-py", num_kv_blocks=1024)
    engine = AsyncLLM.from_llm(llm)
    try:
        result = asyncio.run(storm(engine, prompts, params, keep_states(llm.engine.processor)))
    finally:
        engine.shutdown()
    check(result, expected)
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


@needs_nixl
def test_a_cancellation_storm_over_the_disaggregated_engine(reference):
    _, prompts, params, expected = reference
    with DisaggregatedLLM("tiny-py", num_kv_blocks=512, kv_lease_s=10, start_timeout=120) as pd:
        engine = AsyncLLM.from_llm(pd)
        try:
            result = asyncio.run(storm(engine, prompts, params, keep_states(pd.processor)))
        finally:
            engine.shutdown()
        check(result, expected)
        assert not pd.has_unfinished_requests()
        wait_until_blocks_free(pd)  # every worker let go of every request's blocks


def test_deltas_carry_their_logprobs_and_bad_input_is_refused():
    engine = AsyncLLM("tiny-py")

    async def run() -> None:
        params = SamplingParams(temperature=0.7, seed=3, max_tokens=12, logprobs=3, ignore_eos=True)
        deltas = [d async for d in engine.generate("def fib(n):", params, request_id="x")]
        final = deltas[-1].output
        assert [d.logprobs for d in deltas] == final.logprobs and len(final.logprobs) == 12
        assert all(d.token_id in d.logprobs for d in deltas)
        with pytest.raises(ParameterError, match="prompt"):
            [d async for d in engine.generate(["a", "b"], params)]
        with pytest.raises(ValueError, match="outside the vocabulary"):  # found by the engine's thread
            [d async for d in engine.generate([10 ** 9], params)]
        with pytest.raises(ValueError, match="empty string"):
            [d async for d in engine.generate("", params)]
        await engine.abort(["nobody", "x"])  # unknown and finished ids are ignored
        first = engine.generate("def a():", SamplingParams(max_tokens=50), request_id="dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            [d async for d in engine.generate("def b():", params, request_id="dup")]
        await first.aclose()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine.llm.engine.block_manager.num_used_blocks == 0

    async def after() -> None:
        [d async for d in engine.generate("def fib(n):")]

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(after())


def test_requests_finished_by_another_caller_of_the_same_engine_still_reach_their_consumer(reference):
    """A second ``AsyncLLM`` (or the ``LLM``'s own ``generate``) may take the step that ends a request: its last
    delta still reaches the consumer, though this front end's thread never stepped it."""
    llm, prompts, params, want = reference
    idle = AsyncLLM.from_llm(llm)
    idle._engine.busy = lambda: False  # this one never steps: the other always wins the race
    other = AsyncLLM.from_llm(llm)  # it steps whenever the engine has work, ours included

    async def run() -> list[int]:
        return [d.token_id async for d in idle.generate(prompts[0], params[0])]

    try:
        assert asyncio.run(asyncio.wait_for(run(), timeout=30)) == want[0]
    finally:
        idle.shutdown()
        other.shutdown()


def test_each_request_gets_its_deltas_in_order_when_the_event_loop_falls_behind(reference):
    """The event loop hands out at most ``HAND_OVER_PER_TURN`` requests' deltas a turn; when it falls behind the
    engine (blocked here, as a busy server's loop can be), the steps' hand-overs pile up. A request past the first
    turn's share must still get its deltas in the order they were made: a later step's must not overtake them."""
    llm, prompts, params, want = reference
    count = 48  # three turns' worth of requests
    engine = AsyncLLM.from_llm(llm)

    async def run() -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}

        async def consume(i: int) -> None:
            got[i] = [d.token_id async for d in engine.generate(prompts[i], params[i])]

        tasks = [asyncio.create_task(consume(i)) for i in range(count)]
        while len(engine._streams) < count:  # every request admitted, and being stepped
            await asyncio.sleep(0.001)
        for _ in range(4):
            time.sleep(0.2)  # the loop blocked: several steps' hand-overs queue up behind each other
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return got

    try:
        got = asyncio.run(asyncio.wait_for(run(), timeout=60))
    finally:
        engine.shutdown()
    for i in range(count):
        assert got[i] == want[i], f"request {i}"
