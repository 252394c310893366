"""The step loop without a model: minipd's own scheduler driven by a fake executor and a fake clock.

A simulator reuses :class:`~minipd.engine.step_core.StepCore` (scheduler, block manager, the after-step
bookkeeping) and replaces only the model. These tests check that doing so changes nothing: given a
real run's tokens and step durations, the model-free loop makes exactly the same batches (same
requests, same chunk sizes, same preemptions, same prefix hits) at exactly the same times.
"""

from __future__ import annotations

import pytest

from minipd import LLM, SamplingParams
from minipd.engine.request import Request
from minipd.engine.scheduler import ScheduledBatch, Scheduler
from minipd.engine.step_core import StepCore, StepResult
from minipd.kv.block_manager import BlockManager


class RecordingExecutor:
    """Wraps the real executor: keeps each step's composition."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.steps.append(composition(batch))
        return self.inner.execute(batch)


def composition(batch: ScheduledBatch) -> tuple:
    return (tuple((r.request_id, n, r.num_computed_tokens) for r, n in batch.entries),
            tuple(r.request_id for r in batch.preempted))


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class ReplayExecutor:
    """Samples the tokens a real run produced, and takes as long as its steps took."""

    def __init__(self, tokens: dict[str, list[int]], durations: list[float], clock: FakeClock) -> None:
        self.tokens, self.durations, self.clock, self.steps = tokens, durations, clock, []

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.steps.append(composition(batch))
        self.clock.now += self.durations[len(self.steps) - 1]
        sampled = [r for r, n in batch.entries if r.samples_after(n)]
        tokens = [self.tokens[r.request_id][r.num_output_tokens] for r in sampled]
        return StepResult(sampled, tokens, [None] * len(sampled), {})


@pytest.mark.parametrize("policy", ["decode-first", "prefill-first"])
def test_a_fake_executor_reproduces_a_real_runs_batches(policy):
    # A pool small enough to preempt, a token budget small enough to chunk, shared prefixes to hit.
    llm = LLM("tiny-py", num_kv_blocks=14, block_size=16, max_num_batched_tokens=64, max_num_seqs=8,
              scheduling_policy=policy)
    core = llm.engine.core
    recorder = RecordingExecutor(core.executor)
    core.executor = recorder
    arrivals: list[Request] = []
    add = core.scheduler.add

    def adding(request: Request) -> None:
        arrivals.append(Request(request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                                request.params, request.seed, request.eos_token_ids, request.max_model_len,
                                request.arrival_time))
        add(request)

    core.scheduler.add = adding
    ids = llm.tokenizer.encode("def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def __init__(self):\n" * 4)
    prompts = [ids[:40 + 9 * i] for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=i % 2 == 0) for i in range(10)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = list(core.step_stats)
    assert sum(s.num_preemptions for s in stats) > 0, "the real run should preempt"
    assert any(s.prefill_chunk_sizes and max(s.prefill_chunk_sizes) < 40 for s in stats), "... and chunk"
    assert core.block_manager.stats.hit_tokens > 0, "... and hit the prefix cache"

    clock = FakeClock(stats[0].start_time)
    tokens = {r.request_id: o.token_ids for r, o in zip(arrivals, outputs, strict=True)}
    replay = ReplayExecutor(tokens, [s.duration for s in stats], clock)
    cfg = core.config
    scheduler = Scheduler(BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching),
                          cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.scheduling_policy)
    sim = StepCore(scheduler, replay, core.max_model_len, clock=clock)
    for request in arrivals:
        sim.add_request(request)
    finished: dict[str, tuple] = {}
    while sim.has_unfinished_requests():
        for out in sim.step().outputs:
            if out.finished:
                finished[out.request_id] = (out.finish_reason.value, out.num_cached_tokens, out.num_preemptions)
    assert replay.steps == recorder.steps  # same requests, chunk sizes, contexts and preemptions, step by step
    # Time runs on the fake clock only while the executor "computes": steps follow each other back to back.
    durations = [s.duration for s in stats]
    assert [s.duration for s in sim.step_stats] == pytest.approx(durations, abs=1e-9)
    starts = [stats[0].start_time + sum(durations[:i]) for i in range(len(stats))]
    assert [s.start_time for s in sim.step_stats] == pytest.approx(starts, abs=1e-9)
    for field in ("num_prefill_tokens", "num_decode_tokens", "num_context_tokens", "prefill_chunk_sizes",
                  "num_running", "num_waiting", "kv_blocks_used", "num_preemptions", "prefix_hit_tokens"):
        assert [getattr(s, field) for s in sim.step_stats] == [getattr(s, field) for s in stats], field
    for request, out in zip(arrivals, outputs, strict=True):
        assert finished[request.request_id] == (out.finish_reason, out.metrics.cached_tokens,
                                                     out.metrics.preemptions)
    assert scheduler.block_manager.num_used_blocks == 0


def test_a_failing_fake_executor_rolls_the_step_back():
    scheduler = Scheduler(BlockManager(8, 4), 16, 4)
    clock = FakeClock(0.0)

    class Flaky:
        calls = 0

        def execute(self, batch):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise RuntimeError("device lost")
            sampled = [r for r, n in batch.entries if r.samples_after(n)]
            return StepResult(sampled, [7] * len(sampled), [None] * len(sampled), {})

    sim = StepCore(scheduler, Flaky(), 64, clock=clock)
    sim.add_request(Request("a", [1, 2, 3, 4, 5, 6], 6, SamplingParams(max_tokens=3, ignore_eos=True), 0,
                            frozenset(), 64, 0.0))
    assert [o.new_token_ids for o in sim.step().outputs] == [[7]]
    with pytest.raises(RuntimeError, match="device lost"):
        sim.step()
    assert scheduler.waiting and not scheduler.running  # rolled back: waits again, holding nothing of the step
    got = []
    while sim.has_unfinished_requests():
        got += [t for o in sim.step().outputs for t in o.new_token_ids]
    assert got == [7, 7] and scheduler.block_manager.num_used_blocks == 0


def test_each_step_records_how_long_it_waited_for_a_core():
    # A fake run-delay counter that grows by 2 ms during each step's execution and 1 ms between steps: each
    # record keeps the growth over its own step only.
    scheduler = Scheduler(BlockManager(8, 4), 16, 4)
    clock, delay = FakeClock(0.0), [0.0]

    class Waiting:
        def execute(self, batch):
            delay[0] += 0.002
            clock.now += 0.005
            sampled = [r for r, n in batch.entries if r.samples_after(n)]
            return StepResult(sampled, [7] * len(sampled), [None] * len(sampled), {})

    def run_delay():
        delay[0] += 0.0005  # (read before and after each step: 1 ms between steps in all)
        return delay[0]

    sim = StepCore(scheduler, Waiting(), 64, clock=clock, run_delay=run_delay)
    sim.add_request(Request("a", [1, 2, 3, 4, 5], 5, SamplingParams(max_tokens=3, ignore_eos=True), 0,
                            frozenset(), 64, 0.0))
    while sim.has_unfinished_requests():
        sim.step()
    assert [s.cpu_wait for s in sim.step_stats] == pytest.approx([0.0025] * 3)
    # Without a counter (a simulator's steps) nothing is measured.
    plain = StepCore(Scheduler(BlockManager(8, 4), 16, 4), Waiting(), 64, clock=clock)
    plain.add_request(Request("b", [1, 2, 3], 3, SamplingParams(max_tokens=1, ignore_eos=True), 0, frozenset(), 64,
                              0.0))
    plain.step()
    assert [s.cpu_wait for s in plain.step_stats] == [None]


def test_the_engines_steps_carry_their_measured_wait_for_a_core():
    import sys

    llm = LLM("tiny-py")
    llm.generate(["def add(a, b):"] * 3, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    waits = [s.cpu_wait for s in llm.engine.core.step_stats]
    if sys.platform == "linux":
        assert all(w is not None and 0.0 <= w <= s.duration + 1e-3
                   for w, s in zip(waits, llm.engine.core.step_stats, strict=True)), waits
    else:
        assert set(waits) == {None}
