"""The engine core against HF transformers: paged KV cache, prefix caching, chunked prefill,
preemption, requests arriving mid-run and aborts must never change a greedy output.

Every test ends by checking that the KV pool got all its blocks back.
"""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_hf_model

from minipd import LLM, SamplingParams
from minipd.engine.engine import Engine

MAX_TOKENS = 24


def mixed_prompts(n: int = 32, shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, VOCAB, (shared_prefix,), generator=gen).tolist()
    lengths = torch.randint(1, 90, (n,), generator=gen).tolist()
    return [prefix + torch.randint(1, VOCAB, (n_,), generator=gen).tolist() for n_ in lengths]


def params_for(prompts: list[list[int]]) -> list[SamplingParams]:
    # Mixed output lengths too: 1 to MAX_TOKENS new tokens.
    return [SamplingParams(temperature=0, max_tokens=1 + (7 * i) % MAX_TOKENS) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-llama")
    hf = make_hf_model(folder, "llama", max_position_embeddings=512)
    return folder, hf


@pytest.fixture(scope="module")
def references(model_dir):
    """HF generate, one request at a time, for the plain and the shared-prefix prompt sets."""
    _, hf = model_dir
    out = {}
    for key, prompts in {"mixed": mixed_prompts(), "shared": mixed_prompts(shared_prefix=40, seed=1)}.items():
        refs = []
        for ids, p in zip(prompts, params_for(prompts), strict=True):
            with torch.no_grad():
                gen = hf.generate(torch.tensor([ids]), max_new_tokens=p.max_tokens, do_sample=False, pad_token_id=0)
            refs.append(gen[0, len(ids):].tolist())
        out[key] = (prompts, refs)
    return out


def assert_pool_is_whole(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


CONFIGS = {
    "default": {},
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=19),
    "prefill-first": dict(scheduling_policy="prefill-first", max_num_batched_tokens=64),
    "preemption": dict(num_kv_blocks=20, block_size=8),
    "prefill-first-preemption": dict(scheduling_policy="prefill-first", num_kv_blocks=20, block_size=8),
    "few-seqs": dict(max_num_seqs=3, block_size=32),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("workload", ["mixed", "shared"])
def test_greedy_batch_matches_hf(model_dir, references, name, workload):
    folder, _ = model_dir
    prompts, refs = references[workload]
    llm = LLM(folder, **CONFIGS[name])
    outputs = llm.generate(prompts, params_for(prompts))
    mismatched = [i for i, (o, r) in enumerate(zip(outputs, refs, strict=True)) if o.token_ids != r]
    assert mismatched == []
    if "preemption" in name:
        assert llm.engine.scheduler.num_preemptions > 0
        assert sum(o.metrics.preemptions for o in outputs) == llm.engine.scheduler.num_preemptions
    if name == "chunked-prefill":
        assert max(s.num_tokens for s in llm.engine.step_stats) <= 19
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.step_stats)
    if workload == "shared" and name != "no-prefix-cache":
        assert sum(o.metrics.cached_tokens for o in outputs) > 0
    assert_pool_is_whole(llm.engine)


def test_prefix_cache_skips_shared_prefill(model_dir):
    folder, _ = model_dir
    prompts = mixed_prompts(n=16, shared_prefix=64, seed=2)
    computed = {}
    for caching in (True, False):
        llm = LLM(folder, enable_prefix_caching=caching, block_size=16)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm the cache with the prefix
        outs = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=2))
        computed[caching] = sum(o.metrics.prefill_tokens for o in outs)
        if caching:
            assert all(o.metrics.cached_tokens == 64 for o in outs)
            assert llm.engine.block_manager.stats.hit_rate > 0.4
        assert_pool_is_whole(llm.engine)
    assert computed[True] == computed[False] - 15 * 64


def test_requests_arriving_together_wait_one_step_for_a_prefix_being_computed(model_dir):
    folder, hf = model_dir
    prompts = mixed_prompts(n=8, shared_prefix=64, seed=3)
    llm = LLM(folder, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    # Step 0 prefills the first request alone: the others' prefix is being computed in it, and a block
    # is shared only once committed. Step 1 admits the seven others, which reuse it.
    stats = list(llm.engine.step_stats)
    assert stats[0].num_prefill_tokens == len(prompts[0])
    assert stats[1].num_prefill_tokens == sum(len(p) - 64 for p in prompts[1:]) and stats[1].num_decode_tokens == 1
    assert len(stats) == 5
    assert [o.metrics.cached_tokens for o in outs] == [0] + [64] * 7
    for ids, out in zip(prompts, outs, strict=True):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist()
    assert_pool_is_whole(llm.engine)


def test_requests_added_while_others_run(model_dir, references):
    folder, _ = model_dir
    prompts, refs = references["mixed"]
    params = params_for(prompts)
    engine = LLM(folder, max_num_batched_tokens=48).engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:16], params[:16], strict=True)]
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() or len(ids) < 32:
        steps += 1
        if steps == 5:
            ids += [engine.add_request(p, sp) for p, sp in zip(prompts[16:], params[16:], strict=True)]
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).append(delta.token_id)
    assert [tokens[i] for i in ids] == refs
    assert_pool_is_whole(engine)


def test_abort_mid_run_frees_blocks_and_spares_the_rest(model_dir, references):
    folder, _ = model_dir
    prompts, refs = references["mixed"]
    llm = LLM(folder, max_num_batched_tokens=64)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_for(prompts), strict=True)]
    finals = {}
    for _ in range(4):
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = d.output
    running = [r.request_id for r in engine.scheduler.running]
    victims = [*running[:3], engine.scheduler.waiting[0].request_id]
    used_before = engine.block_manager.num_used_blocks
    held = sum(len(engine.core.requests[v].blocks.block_table) for v in victims)
    for v in victims:
        assert engine.abort(v)
    # The mixed prompts share no blocks, so every block the victims held is freed at once.
    assert engine.block_manager.num_used_blocks == used_before - held
    assert not engine.abort(victims[0])  # already gone
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = d.output
    for rid, ref in zip(ids, refs, strict=True):
        if rid not in victims:
            assert finals[rid].token_ids == ref
    assert all(v not in finals for v in victims)
    assert_pool_is_whole(engine)


def test_stream_matches_generate_and_closing_it_aborts(model_dir):
    folder, _ = model_dir
    llm = LLM(folder)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    deltas = list(llm.stream([5, 6, 7], params))
    assert [d.token_id for d in deltas] == llm.generate([[5, 6, 7]], params)[0].token_ids
    stream = llm.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    assert llm.engine.block_manager.num_used_blocks > 0
    stream.close()
    assert_pool_is_whole(llm.engine)


def test_step_stats_record_batch_composition(model_dir):
    folder, _ = model_dir
    llm = LLM(folder, max_num_batched_tokens=32)
    prompts = mixed_prompts(n=6)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    stats = llm.engine.step_stats
    assert sum(s.num_prefill_tokens for s in stats) == sum(len(p) for p in prompts)
    assert sum(s.num_decode_tokens for s in stats) == 6 * 4  # the first token of each comes from prefill
    assert all(s.num_tokens <= 32 for s in stats)
    assert all(s.kv_blocks_used + s.kv_blocks_free == llm.engine.block_manager.num_blocks for s in stats)


def test_prefill_first_admits_new_requests_before_decodes(model_dir):
    folder, _ = model_dir
    for policy, expect_decode_first in (("decode-first", True), ("prefill-first", False)):
        engine = LLM(folder, scheduling_policy=policy, max_num_batched_tokens=20).engine
        engine.add_request([1] * 5, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        engine.step()  # prefill of the first request
        engine.add_request([2] * 60, SamplingParams(temperature=0, max_tokens=2))
        batch = engine.scheduler.schedule()
        first = batch.entries[0]
        assert (first[1] == 1) == expect_decode_first, policy


def test_prefill_only_steps_carry_prefill_or_decodes_never_both(model_dir):
    """vLLM's 2023 scheduling: a step with prefill work (an unfinished prompt first, then new ones) carries no
    decode; decodes step when there is none. Same greedy tokens as the default policy."""
    folder, _ = model_dir
    prompts = mixed_prompts(n=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(folder, max_num_batched_tokens=32).generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, scheduling_policy="prefill-only", max_num_batched_tokens=32)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for delta in engine.step():
            if delta.token_id is not None:
                outputs.setdefault(delta.request_id, []).append(delta.token_id)

    step()
    for prompt in prompts[2:]:  # newcomers arrive while the first ones decode: each one stalls them
        ids.append(engine.add_request(prompt, params))
        step()
    while engine.has_unfinished_requests():
        step()
    assert [outputs[i] for i in ids] == want
    stats = engine.step_stats
    assert all(s.num_prefill_tokens == 0 or s.num_decode_tokens == 0 for s in stats)
    assert sum(s.num_prefill_tokens for s in stats) == sum(len(p) for p in prompts)
    assert sum(s.num_decode_tokens for s in stats) == len(prompts) * 5
    # A prompt longer than the budget goes on first, a newcomer's takes the rest, and the decode waits.
    late = [engine.add_request([3] * 5, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    engine.step()
    late.append(engine.add_request([1] * 60, params))
    engine.step()  # its first 32 tokens
    late.append(engine.add_request([2] * 8, params))
    batch = engine.scheduler.schedule()
    assert [(len(r.prompt_token_ids), n) for r, n in batch.entries] == [(60, 28), (8, 4)]
    engine.scheduler.rollback(batch)
    batch = engine.scheduler.schedule()  # (rolled back whole: the same again)
    assert [(len(r.prompt_token_ids), n) for r, n in batch.entries] == [(60, 28), (8, 4)]
    engine.scheduler.rollback(batch)
    for request_id in late:
        engine.abort(request_id)
    assert_pool_is_whole(engine)


@pytest.mark.parametrize(("option", "value"), [("block_size", 0), ("max_num_seqs", -1), ("num_kv_blocks", 0),
                                               ("max_num_batched_tokens", "x"), ("kv_cache_memory", 0)])
def test_bad_engine_options_name_the_field(model_dir, option, value):
    folder, _ = model_dir
    with pytest.raises(ValueError, match=option):
        LLM(folder, **{option: value})


def test_unknown_option_and_policy_and_backend(model_dir):
    folder, _ = model_dir
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(folder, block_sise=16)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(folder, scheduling_policy="random")
    with pytest.raises(ValueError, match="kernel_backend"):
        LLM(folder, kernel_backend="cuda-magic")


def test_request_too_big_for_the_pool_is_rejected_and_engine_keeps_working(model_dir):
    folder, _ = model_dir
    llm = LLM(folder, num_kv_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=10))
    assert len(llm.generate([[1] * 10], SamplingParams(temperature=0, max_tokens=5))[0].token_ids) <= 5
    # 30 prompt tokens + 3 new ones: the last new token is never stored, so 32 slots are exactly enough.
    exact = llm.generate([[1] * 30], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(exact.token_ids) == 3
    assert_pool_is_whole(llm.engine)


def test_pool_size_from_memory_budget(model_dir):
    folder, _ = model_dir
    llm = LLM(folder, kv_cache_memory=1 << 20, block_size=16)
    per_token = llm.config.kv_bytes_per_token(4)
    assert llm.engine.pool.num_blocks == (1 << 20) // (per_token * 16)
    assert llm.kv_capacity_tokens == llm.engine.pool.num_blocks * 16


def test_interleaved_streams_each_get_every_token(model_dir):
    folder, _ = model_dir
    llm = LLM(folder)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate([[3, 4, 5], [6, 7, 8, 9]], params)]
    a, b = llm.stream([3, 4, 5], params), llm.stream([6, 7, 8, 9], params)
    got: dict[str, list[int]] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            delta = next(live[name], None)
            if delta is None:
                del live[name]
            else:
                got[name].append(delta.token_id)
    assert [got["a"], got["b"]] == expected
    assert_pool_is_whole(llm.engine)


def test_counters_and_step_stats_carry_what_metrics_and_a_step_model_need():
    from minipd import LLM, SamplingParams

    llm = LLM("tiny-py", max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30, 31, 32]]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)]
    ids = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    states = [llm.engine.processor.states[i] for i in ids]
    for _ in range(4):
        llm.engine.step()
    llm.abort(ids[1])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    counters = llm.engine.processor.counters
    assert counters.prompt_tokens == 23 and counters.finished == {"length": 1, "abort": 1}
    assert counters.generation_tokens == sum(len(s.token_ids) for s in states) > 5
    first = llm.engine.step_stats[0]
    # Step 0: a 16-token chunk of the first prompt (the budget), nothing else fits.
    assert first.prefill_chunk_sizes == (16,) and first.num_context_tokens == 16
    second = llm.engine.step_stats[1]
    assert second.prefill_chunk_sizes == (4, 3) and second.num_context_tokens == 20 + 3
    assert second.prefix_queried_tokens >= first.prefix_queried_tokens


def test_engines_on_one_model_keep_their_own_linears_and_leave_the_model_alone():
    from minipd import LLM, SamplingParams
    from minipd.engine.config import EngineConfig
    from minipd.engine.engine import Engine
    from minipd.kernels.cpu_linear import PackedLinear, onednn_available
    from minipd.kernels.int8_linear import Int8Linear
    from minipd.models import load_model

    model, _ = load_model("tiny-py", device="cpu")
    llm = LLM("tiny-py")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate("def fib(n):", greedy)[0].token_ids

    def engine(**options) -> Engine:
        return Engine(model, llm.tokenizer, EngineConfig(num_kv_blocks=64, **options), llm.max_model_len,
                      llm.engine.eos_token_ids)

    packed = engine(linear_backend="onednn") if onednn_available() else None
    plain = engine(linear_backend="torch")
    int8 = engine(weight_dtype="int8")
    assert plain.core.linear_backend == "torch" and not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    if packed is not None:
        assert packed.core.linear_backend == "onednn"
        assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
        # An engine built on a packed engine's model chooses for itself too.
        again = Engine(packed.model, llm.tokenizer, EngineConfig(num_kv_blocks=64, linear_backend="torch"),
                       llm.max_model_len, llm.engine.eos_token_ids)
        assert again.core.linear_backend == "torch"
        assert not any(isinstance(m, PackedLinear) for m in again.model.modules())
    assert any(isinstance(m, Int8Linear) for m in int8.model.modules())
    # The model itself was not changed, and its weights were shared, not copied.
    assert all(type(m).__name__ not in ("PackedLinear", "Int8Linear") for m in model.modules())
    assert plain.model.embed_tokens.weight is model.embed_tokens.weight
    with pytest.raises(ValueError, match="quantized to int8"):
        Engine(int8.model, llm.tokenizer, EngineConfig(num_kv_blocks=64), llm.max_model_len, llm.engine.eos_token_ids)
    for e in [plain] + ([packed] if packed is not None else []):
        state = e.make_request("def fib(n):", greedy)
        e.add(state)
        while e.has_unfinished_requests():
            e.step()
        assert state.token_ids == want
