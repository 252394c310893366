"""minipd.sim.batching: static, dynamic and continuous batching on the real engine, recorded step by step.

Step counts and phases are exact (they depend only on the schedule, not on timing), so the
expected timelines are written out by hand.
"""

from __future__ import annotations

import pytest
from helpers import VOCAB, make_hf_model

from minipd import LLM, SamplingParams
from minipd.exercises.ch04 import reference_continuous_batch_steps, reference_static_batch_steps
from minipd.sim.batching import PHASES, exact_params, run_batched, run_continuous, run_dynamic, run_static

OUTPUT_LENS = [4, 10, 8, 7, 9, 2, 9, 2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batching-llama")
    make_hf_model(folder, "llama", max_position_embeddings=512)
    return folder


def prompts(n: int, length: int = 6, start: int = 1) -> list[list[int]]:
    """Distinct prompts (no prefix-cache hits between them)."""
    return [[(start + 7 * i + j) % (VOCAB - 1) + 1 for j in range(length)] for i in range(n)]


def assert_pool_is_whole(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_static_batches_run_until_their_longest_member_is_done(folder):
    llm = LLM(folder, max_num_seqs=4)
    tl = run_static(llm, prompts(8), exact_params(OUTPUT_LENS), batch_size=4)
    assert tl.scheme == "static"
    assert tl.num_steps == reference_static_batch_steps(OUTPUT_LENS, 4) == 19
    rows = tl.render().splitlines()
    assert rows[1] == "r0 Pddd______"
    assert rows[2] == "r1 Pddddddddd"
    assert rows[5] == "r4 ..........Pdddddddd"
    assert rows[6] == "r5 ..........Pd_______"
    # Idle slots: each request waits for its batch's longest member.
    assert tl.count("idle") == sum(10 - n for n in OUTPUT_LENS[:4]) + sum(9 - n for n in OUTPUT_LENS[4:])
    assert [len(o.token_ids) for o in tl.outputs] == OUTPUT_LENS
    assert tl.ttft_steps() == [1, 1, 1, 1, 11, 11, 11, 11]
    assert tl.finish_steps() == [3, 9, 7, 6, 18, 11, 18, 11]
    assert_pool_is_whole(llm)


def test_continuous_batching_refills_a_slot_at_the_next_step(folder):
    llm = LLM(folder, max_num_seqs=4)
    tl = run_continuous(llm, prompts(8), exact_params(OUTPUT_LENS))
    assert tl.num_steps == reference_continuous_batch_steps(OUTPUT_LENS, 4) == 17
    assert tl.count("idle") == 0
    rows = tl.render().splitlines()
    assert rows[5] == "r4 ....Pdddddddd"  # takes r0's slot the step after r0 finished
    assert rows[6] == "r5 .......Pd"  # takes r3's slot
    # Every step, four requests compute (until the queue runs dry).
    assert all(sum(1 for p in step.phases.values() if p in ("prefill", "decode")) == 4 for step in tl.steps[:9])
    assert_pool_is_whole(llm)


def test_dynamic_batching_starts_a_partial_batch_after_max_wait(folder):
    llm = LLM(folder, max_num_seqs=4)
    params = exact_params([3, 2, 2])
    dyn = run_dynamic(llm, prompts(3), params, batch_size=2, max_wait=2, arrivals=[0, 3, 5])
    assert dyn.render().splitlines()[1:] == ["r0 ..Pdd",
                                             "r1    ..Pd",
                                             "r2      Pd"]
    assert dyn.ttft_steps() == [3, 3, 1]
    static = run_static(llm, prompts(3), params, batch_size=2, arrivals=[0, 3, 5])
    assert static.render().splitlines()[1:] == ["r0 ...Pdd",
                                                "r1    Pd_",
                                                "r2      .Pd"]
    assert static.num_steps == 8 and dyn.num_steps == 7
    assert_pool_is_whole(llm)


def test_an_empty_engine_waits_for_the_next_arrival(folder):
    llm = LLM(folder)
    tl = run_continuous(llm, prompts(2), exact_params([2, 2]), arrivals=[0, 5])
    assert tl.render().splitlines()[1:] == ["r0 Pd", "r1      Pd"]
    assert [s.duration == 0 for s in tl.steps] == [False, False, True, True, True, False, False]
    assert len(tl.step_stats) == 4  # the engine recorded only the steps that ran


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget(folder):
    llm = LLM(folder, max_num_batched_tokens=16)
    long_prompt = prompts(1, length=100, start=50)[0]
    tl = run_continuous(llm, [*prompts(3), long_prompt], exact_params([12, 12, 12, 2]), arrivals=[0, 0, 0, 2])
    tokens = tl.token_rows()[3]
    assert sum(tokens) == 100 + 1  # the prompt, then one decode
    assert max(tokens) == 16 - 3  # what the three decodes leave of the budget
    assert tl.phase_rows()[3].count("prefill") == 8
    assert all(sum(step.tokens.values()) <= 16 for step in tl.steps)
    assert sum(s.num_prefill_tokens for s in tl.step_stats) == 3 * 6 + 100


def test_prefill_first_stalls_decodes_decode_first_never_does(folder):
    stalls = {}
    for policy in ("decode-first", "prefill-first"):
        llm = LLM(folder, max_num_batched_tokens=24, scheduling_policy=policy)
        tl = run_continuous(llm, [*prompts(2), *prompts(4, length=12, start=100)], exact_params([10, 10, 3, 3, 3, 3]),
                            arrivals=[0, 0, 2, 2, 3, 3])
        stalls[policy] = tl.count("stalled")
        assert_pool_is_whole(llm)
    assert stalls["decode-first"] == 0
    assert stalls["prefill-first"] > 0


def test_preemption_shows_in_the_timeline_and_changes_no_output(folder):
    params = exact_params([30] * 4)
    roomy = run_continuous(LLM(folder, block_size=8), prompts(4, length=10), params)
    tight_llm = LLM(folder, block_size=8, num_kv_blocks=12)
    tight = run_continuous(tight_llm, prompts(4, length=10), params)
    preemptions = sum(s.num_preemptions for s in tight.step_stats)
    assert preemptions > 0
    assert tight.count("preempted") == preemptions == sum(o.metrics.preemptions for o in tight.outputs)
    assert tight.num_steps > roomy.num_steps
    assert [o.token_ids for o in tight.outputs] == [o.token_ids for o in roomy.outputs]
    assert_pool_is_whole(tight_llm)


def test_summary_and_phases(folder):
    tl = run_continuous(LLM(folder), prompts(3), exact_params([3, 3, 3]))
    point = tl.summary("x")
    assert point.label == "x" and point.throughput > 0 and point.mean_ttft > 0 and point.mean_tpot > 0
    assert set(p for row in tl.phase_rows() for p in row) <= set(PHASES)
    assert tl.seconds == pytest.approx(sum(s.duration for s in tl.steps))


def test_bad_arguments_are_clear_errors(folder):
    llm = LLM(folder, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        run_static(llm, prompts(4), exact_params([2] * 4), batch_size=4)
    with pytest.raises(ValueError, match="arrivals"):
        run_continuous(llm, prompts(2), exact_params([2, 2]), arrivals=[0])
    with pytest.raises(ValueError, match="SamplingParams"):
        run_continuous(llm, prompts(2), exact_params([2]))
    with pytest.raises(ValueError, match="batch_size"):
        run_batched(llm, prompts(2), exact_params([2, 2]), batch_size=0)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished"):
        run_continuous(llm, prompts(2), exact_params([2, 2]))
