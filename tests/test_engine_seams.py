"""The engine's seams after the restructuring: request ids, prefix-hash safety, moving K/V between
engines, bounded stats, transactional steps, aborting streams, threads, stop strings, seeded
sampling, KV dtypes and token eviction — each checked against exact token ids or values.

Everything runs on the bundled ``tiny-py`` model. Most tests build a fresh :class:`Engine` over the
already loaded weights (:func:`fresh_engine`), which costs a KV pool and no model load.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.engine.output_processor import RequestState
from minipd.engine.request import RequestStatus
from minipd.kv import block_manager
from minipd.kv.block_manager import BlockAllocation, BlockManager, block_hashes
from minipd.models import bundled_models_dir

CODE = '''import os
import sys
from collections import defaultdict


class Registry:
    """Keep track of named handlers and call them in order."""

    def __init__(self, name, parent=None):
        self.name = name
        self.parent = parent
        self.handlers = defaultdict(list)

    def register(self, key, handler):
        if not callable(handler):
            raise TypeError("handler must be callable, got %r" % (handler,))
        self.handlers[key].append(handler)
        return handler

    def dispatch(self, key, *args, **kwargs):
        results = []
        for handler in self.handlers.get(key, []):
            results.append(handler(*args, **kwargs))
        if self.parent is not None:
            results.extend(self.parent.dispatch(key, *args, **kwargs))
        return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    registry = Registry("main")
    for path in argv:
        if os.path.isdir(path):
            registry.register("dir", print)
    return 0


def parse_config(path, defaults=None):
    config = dict(defaults or {})
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError("line %d of %s has no '='" % (number, path))
            config[key.strip()] = value.strip()
    return config
'''


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-py", num_kv_blocks=512, seed=0)


@pytest.fixture(scope="module")
def llm_b():
    """A second, independently loaded tiny-py: the receiving end of K/V hand-offs."""
    return LLM("tiny-py", num_kv_blocks=512, seed=1)


@pytest.fixture(scope="module")
def code_ids(llm):
    ids = llm.tokenizer.encode(CODE)
    assert len(ids) >= 250
    return ids


@pytest.fixture(scope="module")
def hf_greedy():
    """Greedy continuation by HF transformers (fp32, no cache, EOS ignored), memoised."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_models_dir() / "tiny-py", dtype=torch.float32).eval()
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in memo:
            x = torch.tensor([ids])
            out: list[int] = []
            with torch.no_grad():
                for _ in range(n):
                    out.append(int(hf(x).logits[0, -1].argmax()))
                    x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
            memo[key] = out
        return memo[key]

    return run


def fresh_engine(llm: LLM, **options) -> Engine:
    """A new engine (empty pool, empty prefix cache, no ids handed out) over ``llm``'s loaded weights."""
    config = EngineConfig(**{"num_kv_blocks": 256, **options})
    return Engine(llm.model, llm.tokenizer, config, llm.max_model_len, llm.engine.eos_token_ids, seed=0)


def step_until_finished(engine: Engine, states: list[RequestState], max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if all(s.finished for s in states):
            return
        engine.step()
    raise AssertionError(f"requests not finished after {max_steps} steps")


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """``generate`` on a bare engine: the finished outputs, in order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    states = [engine.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for state in states:
        engine.add(state)
    step_until_finished(engine, states)
    return [s.to_output() for s in states]


def assert_pool_is_whole(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    sched = engine.scheduler
    assert not (sched.running or sched.waiting or sched.waiting_for_kv or sched.holding_kv)
    assert not engine.core.requests and not engine.processor.states


# ------------------------------------------------------------------------------------ 1. request ids
def test_request_ids_are_unique_among_live_requests(llm, code_ids):
    engine = fresh_engine(llm)
    prompts = [code_ids[i:i + 10 + i] for i in (0, 20, 40, 60)]
    alone = [o.token_ids for o in llm.generate(prompts, greedy(4))]
    assert engine.add_request(prompts[0], greedy(4), request_id="1") == "1"
    with pytest.raises(ValueError, match="request_id '1'"):
        engine.add_request(prompts[1], greedy(4), request_id="1")
    # Automatic ids skip the caller's live "1".
    assert [engine.add_request(p, greedy(4)) for p in prompts[1:]] == ["0", "2", "3"]
    assert sorted(engine.core.requests) == ["0", "1", "2", "3"]  # the refused add left nothing behind
    assert engine.abort("1")
    assert sorted(engine.core.requests) == ["0", "2", "3"]
    tokens: dict[str, list[int]] = {}
    for _ in range(10):
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).append(delta.token_id)
    assert tokens == {"0": alone[1], "2": alone[2], "3": alone[3]}
    # Finished (or aborted): the id is free again.
    for request_id, prompt, expected in (("1", prompts[0], alone[0]), ("0", prompts[3], alone[3])):
        state = engine.make_request(prompt, greedy(4), request_id=request_id)
        engine.add(state)
        step_until_finished(engine, [state])
        assert state.token_ids == expected
    assert_pool_is_whole(engine)


def test_a_request_holding_kv_keeps_its_id(llm, code_ids):
    engine = fresh_engine(llm)
    held = engine.make_request(code_ids[:20], greedy(1), request_id="0", hold_kv=True)
    engine.add(held)
    step_until_finished(engine, [held])
    assert engine.core.requests["0"].status is RequestStatus.FINISHED_HOLDING_KV
    with pytest.raises(ValueError, match="request_id '0'"):
        engine.add_request(code_ids[:5], greedy(1), request_id="0")
    assert engine.new_request_id() == "1"
    assert engine.release_kv("0")
    assert engine.add_request(code_ids[:5], greedy(1), request_id="0") == "0"
    engine.abort("0")
    assert_pool_is_whole(engine)


# ------------------------------------------------------------------------------ 2. prefix-hash safety
def weak_chain_hash(parent, token_ids):
    """Ignores the parent: equal blocks collide whatever comes before them."""
    return hash(tuple(token_ids)).to_bytes(8, "little", signed=True)


HASHES = {"sha256": None, "ignores-parent": weak_chain_hash, "constant": lambda parent, token_ids: b"collide"}


@pytest.mark.parametrize("name", HASHES)
def test_a_block_after_another_parent_is_never_reused(monkeypatch, name):
    if HASHES[name] is not None:
        monkeypatch.setattr(block_manager, "chain_hash", HASHES[name])
    bs = 4
    x, y, z, tail = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14]
    collide = block_hashes(x + y, bs)[1] == block_hashes(z + y, bs)[1]
    assert collide == (name != "sha256")  # the weak hashes really give A's and B's Y blocks one hash
    bm = BlockManager(16, bs)

    def compute(tokens):
        """Admit ``tokens`` with their cached prefix, then commit all their blocks as a step would."""
        alloc = BlockAllocation()
        hits = bm.find_cached_prefix(tokens)
        assert bm.allocate(alloc, len(tokens), hits)
        bm.register_full_blocks(alloc, tokens, len(tokens))
        return hits, alloc.block_table

    _, a = compute(x + y + tail)
    assert bm.find_cached_prefix(z + y + tail) == []
    hits, b = compute(z + y + tail)
    assert hits == []
    # Z+Y again: Z is B's block; Y may only be B's own (never A's, computed after X).
    again = bm.find_cached_prefix(z + y + tail)
    assert again == {"sha256": b[:2], "ignores-parent": b[:1], "constant": []}[name]
    assert a[1] not in again


def test_weak_hash_never_hands_out_wrong_kv(monkeypatch, llm, code_ids, hf_greedy):
    monkeypatch.setattr(block_manager, "chain_hash", weak_chain_hash)
    engine = fresh_engine(llm)
    x, y, z = code_ids[0:16], code_ids[16:32], code_ids[100:116]
    tail1, tail2 = code_ids[40:45], code_ids[60:67]
    # One after another, so each sees the blocks the previous ones committed.
    for prompt, cached in ((x + y + tail1, 0), (z + y + tail1, 0), (z + y + tail2, 16)):
        (out,) = run(engine, [prompt], greedy(8))
        assert out.token_ids == hf_greedy(prompt, 8)
        assert out.metrics.cached_tokens == cached  # Z from the second prompt; Y not from the first
    assert_pool_is_whole(engine)


# ------------------------------------------------------------------------------- 3/4. K/V hand-off
@pytest.fixture(scope="module")
def handoff(llm, code_ids):
    """Prefill on engine A with ``hold_kv`` and export: (prompt, packed K/V, first token, 24-token reference)."""
    memo = {}

    def make(n: int):
        if n not in memo:
            prompt = code_ids[n:2 * n]  # a different text for each length
            (reference,) = llm.generate([prompt], greedy(24))
            a = fresh_engine(llm)
            state = a.make_request(prompt, greedy(1), hold_kv=True)
            request_id = a.add(state)
            step_until_finished(a, [state])
            assert a.core.requests[request_id].status is RequestStatus.FINISHED_HOLDING_KV
            assert a.block_manager.num_used_blocks == -(-n // 16)
            packed = a.export_kv(request_id)
            assert packed.spec == a.core.kv_spec and packed.num_tokens == n
            assert packed.num_blocks == -(-n // 16)
            assert tuple(packed.layers[0].shape) == (2, packed.num_blocks, 16, 2, 32)
            assert a.release_kv(request_id) and not a.release_kv(request_id)
            assert_pool_is_whole(a)
            memo[n] = prompt, packed, state.token_ids[0], reference.token_ids
        return memo[n]

    return make


@pytest.mark.parametrize("n", [37, 32])  # a partial last block, and whole blocks only
def test_kv_handoff_to_a_busy_engine(llm, llm_b, code_ids, handoff, n):
    prompt, packed, first, reference = handoff(n)
    assert first == reference[0]
    b = fresh_engine(llm_b)
    companion = b.make_request(code_ids[200:210], greedy(40))
    b.add(companion)
    b.step()  # the companion is prefilled; from now on it adds one decode token per step
    mark = b.core.num_steps
    state = b.make_request([*prompt, first], greedy(23), num_external_tokens=n)
    b.add(state, kv=packed)
    step_until_finished(b, [state])
    assert [first, *state.token_ids] == reference
    stats = [(s.num_prefill_tokens, s.num_decode_tokens) for s in b.step_stats if s.step >= mark]
    # The K/V arrive in the first step (only the companion computes); then the request computes
    # `first`, a prompt token for it (so counted as one prefill token), then decodes.
    assert stats == [(0, 1), (1, 1)] + [(0, 2)] * 22
    assert (state.metrics.prefill_tokens, state.metrics.cached_tokens) == (1, 0)
    b.abort(companion.request_id)
    assert_pool_is_whole(b)


def test_kv_handoff_to_an_idle_engine(llm_b, handoff):
    prompt, packed, first, reference = handoff(37)
    b = fresh_engine(llm_b)
    state = b.make_request([*prompt, first], greedy(23), num_external_tokens=37)
    b.add(state, kv=packed)
    step_until_finished(b, [state])
    assert [first, *state.token_ids] == reference
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in b.step_stats] == [(1, 0)] + [(0, 1)] * 22


@pytest.mark.parametrize("arrival", ["import_kv", "finish_kv_load"])
def test_request_waits_for_its_kv_while_others_run(llm, llm_b, code_ids, handoff, arrival):
    prompt, packed, first, reference = handoff(37)
    other_prompt = code_ids[150:163]
    (other_alone,) = llm.generate([other_prompt], greedy(12))
    b = fresh_engine(llm_b)
    state = b.make_request([*prompt, first], greedy(23), num_external_tokens=37)
    request_id = b.add(state)
    other = b.make_request(other_prompt, greedy(12))
    b.add(other)
    request = state.request
    for i in range(4):
        deltas = b.step()
        assert [d.request_id for d in deltas] == [other.request_id]
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
        assert (request.num_computed_tokens, request.num_prefill_tokens) == (0, 0)
        last = b.step_stats[-1]
        assert (last.num_waiting_for_kv, last.num_tokens) == (1, len(other_prompt) if i == 0 else 1)
    blocks = b.core.kv_blocks_of(request_id)
    assert len(blocks) == packed.num_blocks == 3
    if arrival == "import_kv":
        b.core.import_kv(request_id, packed)
    else:  # written straight into the blocks, as a NIXL-style transfer would
        b.pool.import_blocks(blocks, packed)
        b.core.finish_kv_load(request_id)
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING, 37)
    step_until_finished(b, [state, other])
    assert [first, *state.token_ids] == reference
    assert other.token_ids == other_alone.token_ids
    assert state.metrics.prefill_tokens == 1  # `first` only
    assert_pool_is_whole(b)


def test_kv_and_external_token_counts_are_checked(llm_b, handoff):
    prompt, packed, first, reference = handoff(37)
    b = fresh_engine(llm_b)
    ids = [*prompt, first]
    other_blocks = dataclasses.replace(packed, spec=dataclasses.replace(packed.spec, block_size=8))
    other_dtype = dataclasses.replace(packed, spec=dataclasses.replace(packed.spec, dtype=torch.float16))
    bad = [(other_blocks, 37, "KV format"), (other_dtype, 37, "KV format"), (packed, 36, "holds 37 tokens"),
           (None, 38, "num_external_tokens"), (None, 39, "num_external_tokens"), (None, -1, "num_external_tokens")]
    for kv, external, match in bad:
        state = b.make_request(ids, greedy(4), num_external_tokens=external)
        with pytest.raises(ValueError, match=match):
            b.add(state, kv=kv)
        assert not b.core.requests and not b.processor.states  # refused: nothing left behind
    # Arriving later: a wrong import is refused and the request keeps waiting for the right one.
    state = b.make_request(ids, greedy(4), num_external_tokens=37)
    request_id = b.add(state)
    b.step()
    with pytest.raises(ValueError, match="KV format"):
        b.core.import_kv(request_id, other_blocks)
    with pytest.raises(ValueError, match="holds 36 tokens"):
        b.core.import_kv(request_id, dataclasses.replace(packed, num_tokens=36))
    assert state.request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    b.core.import_kv(request_id, packed)
    with pytest.raises(ValueError, match="not waiting for KV"):
        b.core.import_kv(request_id, packed)
    step_until_finished(b, [state])
    assert [first, *state.token_ids] == reference[:5]
    assert_pool_is_whole(b)


def test_kv_given_for_a_cached_prefix_is_not_kept(llm_b, handoff):
    prompt, packed, first, reference = handoff(32)
    b = fresh_engine(llm_b)
    run(b, [prompt], greedy(2))  # the prompt's two blocks are now in b's prefix cache
    state = b.make_request([*prompt, first], greedy(23), num_external_tokens=32)
    b.add(state, kv=packed)
    step_until_finished(b, [state])
    assert [first, *state.token_ids] == reference
    assert_pool_is_whole(b)
    assert b.core._imports == {}


# --------------------------------------------------------------------------------- 5. bounded stats
def test_step_stats_keep_only_the_last_steps(code_ids):
    llm5 = LLM("tiny-py", stats_history=5, num_kv_blocks=64)
    seen = []
    llm5.engine.core.step_callbacks.append(seen.append)
    (out,) = llm5.generate([code_ids[:30]], greedy(20))
    assert len(out.token_ids) == 20  # one prefill step, then 19 decode steps
    stats = list(llm5.engine.step_stats)
    assert [s.step for s in stats] == [15, 16, 17, 18, 19]
    assert [s.step for s in seen] == list(range(20)) and seen[-5:] == stats
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in seen] == [(30, 0)] + [(0, 1)] * 19


# --------------------------------------------------------------------------- 6. transactional step
@pytest.mark.parametrize("via", ["generate", "step"])
def test_a_step_that_raises_leaves_no_trace(monkeypatch, llm, code_ids, hf_greedy, via):
    bs = 8
    engine = fresh_engine(llm, block_size=bs, max_num_batched_tokens=24)
    monkeypatch.setattr(llm, "engine", engine)  # llm.generate drives this chunked-prefill engine
    short, long = code_ids[:6], code_ids[10:80]
    share = long[:48] + code_ids[200:210]  # shares six blocks with `long`
    batches = []
    execute = engine.core.runner.execute

    def recording_execute(batch):
        batches.append([(r, n, r.num_computed_tokens, list(r.blocks.block_table)) for r, n in batch.entries])
        return execute(batch)

    monkeypatch.setattr(engine.core.runner, "execute", recording_execute)
    calls = []

    def fail_second_step(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")

    handle = engine.model.layers[1].register_forward_hook(fail_second_step)
    try:
        if via == "generate":
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate([short, long], greedy(12))
            assert_pool_is_whole(engine)  # generate aborted what it had queued
        else:
            states = [engine.make_request(p, greedy(12)) for p in (short, long)]
            for state in states:
                engine.add(state)
            engine.step()
            with pytest.raises(RuntimeError, match="injected"):
                engine.step()
            # Back to waiting, in order, holding nothing; `short` keeps the token it already had.
            assert list(engine.scheduler.waiting) == [s.request for s in states] and not engine.scheduler.running
            assert all(s.request.num_computed_tokens == 0 and not s.request.blocks.block_table for s in states)
            assert len(states[0].token_ids) == 1
    finally:
        handle.remove()
    assert len(batches) == 2 and engine.core.num_steps == 1
    failed = batches[-1]
    written, committed = set(), set()
    for _, n, done, table in failed:
        written.update(table[done // bs:(done + n - 1) // bs + 1])
        committed.update(table[:done // bs])
    assert any(n > 1 and (done + n) // bs > done // bs for _, n, done, _ in failed)  # a chunk completed blocks
    cached = set(engine.block_manager.cached.values())
    assert not cached & written and cached == committed  # only blocks of steps that finished
    if via == "generate":
        outs = llm.generate([short, long, share], greedy(12))
        assert [o.token_ids for o in outs] == [hf_greedy(p, 12) for p in (short, long, share)]
        assert outs[1].metrics.cached_tokens == bs * len(committed)  # only what the failed step lost is redone
    else:
        step_until_finished(engine, states)
        assert [s.token_ids for s in states] == [hf_greedy(p, 12) for p in (short, long)]
        (out,) = run(engine, [share], greedy(12))
        assert out.token_ids == hf_greedy(share, 12)
    assert_pool_is_whole(engine)


def test_a_failed_step_leaves_no_trace_in_the_counters(llm, code_ids):
    engine = fresh_engine(llm)
    run(engine, [code_ids[:40]], greedy(2))  # caches two blocks
    prompt = code_ids[:40] + code_ids[100:110]
    (expected,) = llm.generate([prompt], greedy(3))

    def fail(*_):
        raise RuntimeError("injected")

    handle = engine.model.layers[1].register_forward_hook(fail)
    state = engine.make_request(prompt, greedy(3))
    engine.add(state)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()  # admits the request with its two cached blocks, then fails
    finally:
        handle.remove()
    step_until_finished(engine, [state])
    assert state.token_ids == expected.token_ids
    assert (state.metrics.cached_tokens, state.metrics.prefill_tokens) == (32, 18)
    stats = engine.block_manager.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (40 + 50, 32)


# ------------------------------------------------------------------------------ 7. abort a stream
def test_abort_ends_a_stream_with_an_abort_delta(monkeypatch, llm, code_ids):
    prompt, other_prompt = code_ids[:12], code_ids[30:41]
    (other_alone,) = llm.generate([other_prompt], greedy(10))
    # A stream steps the engine until its request's next delta arrives: should the abort delta never
    # come, it would spin without yielding, so bound the steps it may take instead.
    step, steps = llm.engine.step, []

    def bounded_step():
        steps.append(1)
        if len(steps) > 40:
            raise AssertionError("the streams took over 40 steps: is one waiting for a delta that never comes?")
        return step()

    monkeypatch.setattr(llm.engine, "step", bounded_step)
    other = llm.stream(other_prompt, greedy(10))
    other_tokens = [next(other).token_id]
    stream = llm.stream(prompt, greedy(50))
    first = [next(stream), next(stream)]
    assert all(d.token_id is not None and d.finish_reason is None for d in first)
    request_id = first[1].request_id
    assert llm.abort(request_id)
    rest = list(itertools.islice(stream, 5))  # bounded, should a regression keep the stream going
    assert len(rest) == 1
    last = rest[0]
    assert (last.request_id, last.token_id, last.finish_reason, last.text) == (request_id, None, "abort", "")
    assert last.output.token_ids == [d.token_id for d in first]
    with pytest.raises(StopIteration):
        next(stream)
    assert not llm.abort(request_id)
    other_tokens += [d.token_id for d in itertools.islice(other, 20)]
    assert other_tokens == other_alone.token_ids
    assert_pool_is_whole(llm.engine)


def _three_steps(engine, request) -> list[int]:
    """Three steps of ``engine``; the three tokens ``request`` has then."""
    for _ in range(3):
        engine.step()
    assert len(request.token_ids) == 3
    return list(request.token_ids)


def _step_with_an_abort_midway(monkeypatch, engine, request_id: str, check):
    """One step of ``engine`` during which ``request_id``'s abort is asked for, as a server's event loop would
    from its thread: after the core's step (whose outputs ``check`` sees first), before they are applied."""
    core_step = engine.core.step

    def step():
        outputs = core_step()
        check(outputs)
        engine.request_abort(request_id)
        return outputs

    monkeypatch.setattr(engine.core, "step", step)
    try:
        return engine.step()
    finally:
        monkeypatch.undo()


def test_an_abort_asked_for_mid_step_lands_before_the_steps_tokens(monkeypatch, llm, code_ids):
    # A server's event loop asks (request_abort) while the engine's thread is inside a step: the request must
    # not take that step's token, the other request must, and an abort asked for before a request with the
    # same id came in must not end the newcomer.
    engine = fresh_engine(llm)
    prompt, other_prompt = code_ids[:12], code_ids[30:41]
    (other_alone,) = llm.generate([other_prompt], greedy(6))
    doomed = engine.make_request(prompt, greedy(20), request_id="doomed")
    other = engine.make_request(other_prompt, greedy(6), request_id="other")
    engine.add(doomed)
    engine.add(other)
    tokens_before = _three_steps(engine, doomed)

    def check(outputs):
        assert any(o.request_id == "doomed" and o.new_token_ids for o in outputs.outputs)

    deltas = _step_with_an_abort_midway(monkeypatch, engine, "doomed", check)
    assert doomed.token_ids == tokens_before and doomed.finish_reason == "abort"
    assert [d.finish_reason for d in deltas if d.request_id == "doomed"] == ["abort"]
    assert [d.token_id is not None for d in deltas if d.request_id == "other"] == [True]
    engine.request_abort("late")  # an id nobody uses yet: ignored, and not held against a request named so later
    late = engine.make_request(prompt, greedy(4), request_id="late")
    engine.add(late)
    step_until_finished(engine, [other, late])
    assert other.token_ids == other_alone.token_ids
    assert late.finish_reason == "length" and len(late.token_ids) == 4
    assert_pool_is_whole(engine)


def test_an_abort_asked_for_in_the_step_that_finishes_the_request_still_ends_it_as_aborted(monkeypatch, llm,
                                                                                            code_ids):
    # The step makes the request's last token, so the core lets go of it and its abort there ends nothing: the
    # front end ends it all the same, that token not handed out (a disaggregated cluster can hand over several
    # tokens at once there, kept back for a transfer report: a client that had hung up got them after its abort).
    engine = fresh_engine(llm)
    doomed = engine.make_request(code_ids[:12], greedy(4), request_id="doomed")
    engine.add(doomed)
    tokens_before = _three_steps(engine, doomed)

    def check(outputs):
        (last,) = [o for o in outputs.outputs if o.request_id == "doomed"]
        assert last.new_token_ids and last.finish_reason is not None  # the core is done with it

    deltas = _step_with_an_abort_midway(monkeypatch, engine, "doomed", check)
    assert doomed.token_ids == tokens_before and doomed.finish_reason == "abort"
    assert [(d.token_id, d.finish_reason) for d in deltas if d.request_id == "doomed"] == [(None, "abort")]
    assert "doomed" not in engine.processor.states and not engine.has_unfinished_requests()
    assert_pool_is_whole(engine)


# ----------------------------------------------------------------------------------- 8. threads
def test_threads_share_one_llm(llm, code_ids):
    # Its own LLM front (engine and lock) over the loaded weights: a thread left hanging by a
    # regression then cannot block the tests that come after.
    llm = copy.copy(llm)
    llm.engine, llm._lock = fresh_engine(llm), threading.RLock()
    n = 48
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=n, ignore_eos=True)
    jobs = {
        "greedy": lambda: [o.token_ids for o in llm.generate([code_ids[:9], code_ids[40:77]], greedy(n))],
        "sampled": lambda: [o.token_ids for o in llm.generate([code_ids[80:95], code_ids[120:142]], sampled)],
        "stream": lambda: [[d.token_id for d in llm.stream(code_ids[160:171], greedy(n))]],
    }
    alone = {name: job() for name, job in jobs.items()}
    assert all(len(tokens) == n for lists in alone.values() for tokens in lists)
    results, errors = {}, []
    barrier = threading.Barrier(len(jobs), timeout=30)

    def work(name):
        try:
            barrier.wait()
            results[name] = jobs[name]()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,), daemon=True) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert results == alone
    assert_pool_is_whole(llm.engine)


# ------------------------------------------------------------------------------ 9. stop strings
def test_stop_string_spanning_tokens_is_never_streamed(llm, code_ids):
    prompt = code_ids[:40]
    (full,) = llm.generate([prompt], greedy(40))
    tok = llm.tokenizer
    ends = [len(tok.decode(full.token_ids[:k])) for k in range(1, 41)]  # where each token's text ends
    assert all(full.text.startswith(tok.decode(full.token_ids[:k])) for k in range(1, 41))
    # A 4-character stop string that starts 2 characters before a token boundary (so spans >= 2 tokens),
    # first occurs there, and whose first half occurred earlier (so the stream must hold text back and release it).
    candidates = [(end - 2, full.text[end - 2:end + 2]) for end in ends[:-1] if end >= 4]
    candidates = [(start, stop) for start, stop in candidates if len(stop) == 4 and full.text.find(stop) == start]
    held_then_released = [(start, stop) for start, stop in candidates if stop[:2] in full.text[:start]]
    start, stop = (held_then_released or candidates)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    deltas = list(itertools.islice(llm.stream(prompt, params), 60))
    (final,) = llm.generate([prompt], params)
    assert final.text == full.text[:start] and (final.finish_reason, final.stop_reason) == ("stop", stop)
    # It ends with the token that completed the stop string.
    assert final.token_ids == full.token_ids[:next(k for k, end in enumerate(ends, 1) if end >= start + 4)]
    assert "".join(d.text for d in deltas) == final.text
    shown = ""
    for delta in deltas:
        shown += delta.text
        assert final.text.startswith(shown)
    assert [d.token_id for d in deltas] == final.token_ids
    assert deltas[-1].finish_reason == "stop" and deltas[-1].output.text == final.text
    assert_pool_is_whole(llm.engine)


def test_a_hold_kv_request_ended_by_a_stop_string_keeps_its_kv(llm, code_ids):
    """The front end finds stop strings, but the core must still hold the request's K/V, as for a stop token."""
    engine = fresh_engine(llm)
    prompt = code_ids[:20]
    (full,) = llm.generate([prompt], greedy(12))
    stop = llm.tokenizer.decode(full.token_ids[2:4])
    assert stop and stop not in llm.tokenizer.decode(full.token_ids[:2])
    state = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=12, stop=stop), hold_kv=True)
    request_id = engine.add(state)
    step_until_finished(engine, [state])
    assert state.finish_reason == "stop" and state.stop_reason == stop
    assert engine.core.requests[request_id].status is RequestStatus.FINISHED_HOLDING_KV
    packed = engine.export_kv(request_id)
    assert packed.num_tokens == engine.core.requests[request_id].num_computed_tokens >= len(prompt)
    assert engine.release_kv(request_id)
    assert_pool_is_whole(engine)


# ------------------------------------------------------------------------------ 10. seeded sampling
def test_seeded_sampling_is_the_same_in_any_batch(llm, code_ids):
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    lengths = [45, 12, 70, 5, 33, 60, 21, 8, 50]
    prompts = [code_ids[i * 20:i * 20 + n] for i, n in enumerate(lengths)]
    params = [greedy(24) if i % 3 == 0 else SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24,
                                                              ignore_eos=True) for i in range(len(prompts))]
    params[7] = seeded  # in the small pool below, this one is preempted twice
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert alone[7] != llm.generate([prompts[7]], greedy(24))[0].token_ids  # it really samples
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in batched] == alone
    small = fresh_engine(llm, num_kv_blocks=24, block_size=8)
    outs = run(small, prompts, params)
    assert small.scheduler.num_preemptions > 0 and outs[7].metrics.preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert_pool_is_whole(small)


# ----------------------------------------------------------------------------------- 11. KV dtype
def test_float16_kv_cache_under_an_fp32_model(llm, code_ids):
    llm16 = LLM("tiny-py", kv_cache_dtype="float16", kernel_backend="torch", num_kv_blocks=64)
    pool = llm16.engine.pool
    assert llm16.dtype == torch.float32 and pool.k.dtype == pool.v.dtype == torch.float16
    assert pool.nbytes * 2 == fresh_engine(llm, num_kv_blocks=64).pool.nbytes
    prompt = code_ids[:30]
    (out16,) = llm16.generate([prompt], greedy(16))
    (out32,) = llm.generate([prompt], greedy(16))
    assert len(out16.token_ids) == 16
    assert out16.token_ids[:4] == out32.token_ids[:4]


def test_triton_refuses_a_block_size_it_cannot_run():
    with pytest.raises(ValueError, match=r"power-of-two block_size .*got 12"):
        LLM("tiny-py", kernel_backend="triton", block_size=12, num_kv_blocks=8)


# ------------------------------------------------------------------------------ 12. token eviction
def test_drop_blocks_releases_blocks_from_the_middle():
    bm = BlockManager(8, 4)
    alloc = BlockAllocation()
    assert bm.allocate(alloc, 12)
    table = list(alloc.block_table)
    bm.register_full_blocks(alloc, list(range(1, 13)), 12)
    pinned = bm.pin([table[2]])  # the last block is shared with a reader
    bm.drop_blocks(alloc, [1], 12)
    assert alloc.block_table == [table[0], table[2]]
    assert bm.blocks[table[1]].ref_count == 0 and table[1] in bm.free and bm.num_free_blocks == 6
    assert (alloc.num_dropped_tokens, len(alloc.committed_hashes)) == (4, 1)
    assert bm.blocks_needed(alloc, 16) == 1  # 16 tokens less the 4 dropped need three blocks
    with pytest.raises(ValueError, match="block indices"):
        bm.drop_blocks(alloc, [2], 12)
    with pytest.raises(ValueError, match="the full blocks"):
        bm.drop_blocks(alloc, [1], 11)  # the last block is only partly filled: the next token goes there
    bm.drop_blocks(alloc, [1], 12)  # a shared block: dropping lets go of this sequence's reference only
    assert alloc.block_table == [table[0]] and alloc.num_dropped_tokens == 8
    assert bm.blocks[table[2]].ref_count == 1 and table[2] not in bm.free
    bm.free_blocks(alloc)
    bm.free_blocks(pinned)
    assert bm.num_free_blocks == 8 and alloc.num_dropped_tokens == 0


def capture_prepare(monkeypatch, engine: Engine) -> list[dict]:
    """Record what ModelRunner.prepare builds each step (copied: on CPU they are views of reused buffers)."""
    seen = []
    prepare = engine.core.runner.prepare

    def recording_prepare(batch):
        ids, positions, meta, to_sample, rows = prepare(batch)
        seen.append(dict(ids=ids.tolist(), positions=positions.tolist(), slots=meta.slot_mapping.tolist(),
                         decode_lens=list(meta.decode_context_lens_host),
                         decode_tables=meta.decode_block_tables.tolist(),
                         prefill_lens=list(meta.prefill_context_lens_host)))
        return ids, positions, meta, to_sample, rows

    monkeypatch.setattr(engine.core.runner, "prepare", recording_prepare)
    return seen


def test_decode_after_a_dropped_block_writes_the_right_slot(monkeypatch, llm, code_ids):
    bs = 8
    engine = fresh_engine(llm, block_size=bs)
    state = engine.make_request(code_ids[:26], greedy(8))
    engine.add(state)
    engine.step()
    request = state.request
    table = list(request.blocks.block_table)
    assert request.num_computed_tokens == 26 and len(table) == 4
    cached = dict(engine.block_manager.cached)
    engine.block_manager.drop_blocks(request.blocks, [1], request.num_computed_tokens)
    assert request.blocks.block_table == [table[0], table[2], table[3]]
    assert engine.block_manager.blocks[table[1]].ref_count == 0 and request.blocks.num_dropped_tokens == bs
    slot = table[3] * bs + 2  # position 26 -> cache index 18 -> third block of the new table, offset 2
    assert not engine.pool.k[:, table[3], 2].any()
    seen = capture_prepare(monkeypatch, engine)
    engine.step()
    (step,) = seen
    assert step["positions"] == [26] and step["ids"] == [request.all_token_ids[26]]
    assert step["slots"] == [slot]
    assert step["decode_lens"] == [27 - bs] and step["decode_tables"] == [[table[0], table[2], table[3]]]
    assert engine.pool.k[:, table[3], 2].abs().sum(dim=(-1, -2)).gt(0).all()  # written in every layer
    assert len(state.token_ids) == 2 and engine.block_manager.cached == cached  # nothing new registered
    with pytest.raises(ValueError, match="dropped blocks"):
        engine.export_kv(state.request_id)
    engine.abort(state.request_id)
    assert_pool_is_whole(engine)


def test_prefill_chunk_after_a_dropped_block_keeps_true_positions(monkeypatch, llm, code_ids):
    bs = 8
    engine = fresh_engine(llm, block_size=bs, max_num_batched_tokens=16)
    state = engine.make_request(code_ids[:40], greedy(4))
    engine.add(state)
    engine.step()  # tokens 0..15: two full blocks
    request = state.request
    kept = request.blocks.block_table[1]
    engine.block_manager.drop_blocks(request.blocks, [0], request.num_computed_tokens)
    seen = capture_prepare(monkeypatch, engine)
    engine.step()  # tokens 16..31 go to cache indices 8..23
    (step,) = seen
    new_table = request.blocks.block_table
    assert new_table[0] == kept and len(new_table) == 3
    assert step["positions"] == list(range(16, 32)) and step["ids"] == request.all_token_ids[16:32]
    assert step["slots"] == [new_table[c // bs] * bs + c % bs for c in range(8, 24)]
    assert step["prefill_lens"] == [32 - bs] and step["decode_lens"] == []
    engine.abort(state.request_id)
    assert_pool_is_whole(engine)


# ------------------------------------------------------------------------------ blocks held elsewhere
def test_blocks_held_for_a_receiver_make_newcomers_wait_not_fail(llm, code_ids):
    """A full pool because a finished request holds its K/V is a wait, not an error; release lets work go on."""
    engine = fresh_engine(llm, num_kv_blocks=8, block_size=8)
    holder = engine.make_request(code_ids[:40], greedy(1), hold_kv=True)  # 5 blocks kept after finishing
    engine.add(holder)
    step_until_finished(engine, [holder])
    (expected,) = llm.generate([code_ids[50:80]], greedy(4))
    newcomer = engine.make_request(code_ids[50:80], greedy(4))  # needs 4 blocks; 3 are free
    engine.add(newcomer)
    for _ in range(3):
        assert engine.step() == []
    assert newcomer.request.status is RequestStatus.WAITING
    assert engine.release_kv(holder.request_id)
    step_until_finished(engine, [newcomer])
    assert newcomer.token_ids == expected.token_ids
    assert_pool_is_whole(engine)


def test_a_request_whose_kv_arrived_is_not_stuck_behind_one_that_cannot_fit(llm, code_ids, handoff):
    prompt, packed, first, reference = handoff(37)
    engine = fresh_engine(llm, num_kv_blocks=7, block_size=16)
    big = engine.make_request(code_ids[:64], greedy(40))  # 4 full blocks after its prefill, then a 5th
    engine.add(big)
    arriving = engine.make_request([*prompt, first], greedy(23), num_external_tokens=37)
    engine.add(arriving, kv=packed)
    engine.step()  # big prefills; arriving's 3 blocks are allocated and filled: the pool is full
    assert engine.block_manager.num_free_blocks == 0
    engine.step()  # big needs a 5th block: it is preempted and goes back to the head of the queue
    assert [r.request_id for r in engine.scheduler.waiting] == [big.request_id, arriving.request_id]
    # big cannot fit while arriving holds its blocks, and nothing runs: arriving must go first.
    step_until_finished(engine, [arriving, big], max_steps=300)
    assert [first, *arriving.token_ids] == reference
    assert big.token_ids == llm.generate([code_ids[:64]], greedy(40))[0].token_ids
    assert_pool_is_whole(engine)


# ------------------------------------------------------------------------------------- eager streams
def test_a_stream_checks_and_queues_its_request_at_once(llm, code_ids):
    with pytest.raises(ValueError, match="got bytes"):
        llm.stream(b"def f():")
    stream = llm.stream(code_ids[:10], greedy(8))
    assert stream.request_id in llm.engine.processor.states  # queued before the first next()
    first = next(stream)
    assert first.request_id == stream.request_id
    del stream, first  # dropped half-way: the request is aborted and its blocks freed
    assert_pool_is_whole(llm.engine)
    unstarted = llm.stream(code_ids[:10], greedy(8))
    unstarted.close()
    assert_pool_is_whole(llm.engine)
