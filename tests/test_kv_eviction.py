"""Token eviction ("presses"): decoding with dropped blocks equals HF attending to exactly the kept
tokens at their true positions; block accounting stays whole; shared prefix blocks are never written;
a reader's own press plugs in."""

from __future__ import annotations

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.kv.block_manager import BlockAllocation, BlockManager
from minipd.kv.press import KVPress, SinkWindowPress
from minipd.models import bundled_models_dir


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py")


def engine_for(llm: LLM, **options) -> Engine:
    config = EngineConfig(**{"num_kv_blocks": 64, "block_size": 8, **options})
    return Engine(llm.model, llm.tokenizer, config, llm.max_model_len, llm.engine.eos_token_ids, seed=0)


def code(llm: LLM, n: int, start: int = 0) -> list[int]:
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nclass Path:\n    pass\n" * 8
    return llm.tokenizer.encode(text)[start:start + n]


@pytest.mark.parametrize("granularity", ["block", "token"])
@pytest.mark.parametrize("press", ["sink-window", "knorm", "h2o", "snapkv", "random"])
def test_decoding_after_eviction_is_hf_attending_to_exactly_the_kept_tokens(llm, press, granularity):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_models_dir() / "tiny-py", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = engine_for(llm, kv_eviction=press, kv_budget=16, kv_eviction_granularity=granularity)
    prompt = code(llm, 30)
    state = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
    engine.add(state)
    request = state.request
    bs = 8
    visible: dict[int, list[int]] = {}  # position fed in a decode step -> positions it could attend to
    while not state.finished:
        p = request.num_computed_tokens
        if p >= len(prompt):
            visible[p] = [*request.blocks.cache_positions(bs, p - request.blocks.num_dropped_tokens), p]
        engine.step()
        assert len(request.blocks.block_table) <= 16 // bs + 2  # the budget, a block over, the partial one
    assert engine.core.num_evicted_blocks > 0 and len(visible) == 39
    if granularity == "token":  # single tokens went, not only whole aligned blocks of them
        def whole_blocks(dropped: set[int]) -> bool:
            return all(b * bs + i in dropped for b in {d // bs for d in dropped} for i in range(bs))

        assert engine.core.num_evicted_tokens > 0
        assert any(not whole_blocks(set(range(p)) - set(v)) for p, v in visible.items())
    ids = prompt + state.token_ids[:-1]  # the last token is produced, never fed
    n = len(ids)
    mask = torch.full((n, n), float("-inf")).triu(1)  # prompt rows: causal
    for p, allowed in visible.items():
        mask[p] = float("-inf")
        mask[p, allowed] = 0.0
    assert any(len(a) < p + 1 for p, a in visible.items())  # some rows really lost tokens
    with torch.no_grad():
        table = hf(torch.tensor([ids]), attention_mask=mask[None, None]).logits[0].log_softmax(-1)
    want = table[len(prompt) - 1:].argmax(-1).tolist()
    assert state.token_ids == want
    for j, token in enumerate(state.token_ids):
        assert state.to_output().logprobs[j][token] == pytest.approx(table[len(prompt) - 1 + j, token].item(),
                                                                       abs=1e-4)
    assert engine.block_manager.num_used_blocks == 0


def test_without_pressure_a_press_changes_nothing(llm):
    prompt = code(llm, 20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = llm.generate([prompt], params)[0].token_ids
    roomy = LLM("tiny-py", kv_eviction="sink-window", kv_budget=64)
    assert roomy.generate([prompt], params)[0].token_ids == plain and roomy.engine.core.num_evicted_blocks == 0


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_shared_prefix_blocks_are_released_never_written(llm, granularity):
    """Block eviction releases a shared block; token eviction, which rewrites blocks to compact them,
    copies a shared one into a private block first."""
    engine = engine_for(llm, kv_eviction="sink-window", kv_budget=16, enable_prefix_caching=True,
                        kv_eviction_granularity=granularity)
    prompt = code(llm, 40)
    first = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    engine.add(first)
    engine.step()  # its blocks are committed to the prefix cache and freed (it ended at one token)
    cached = dict(engine.block_manager.cached)
    contents = {b: engine.pool.k[:, b].clone() for b in cached.values()}
    second = engine.make_request(prompt + code(llm, 8, 60), SamplingParams(temperature=0, max_tokens=24,
                                                                         ignore_eos=True))
    engine.add(second)
    while not second.finished:
        engine.step()
    assert second.metrics.cached_tokens > 0 and engine.core.num_evicted_blocks > 0
    still = [b for b in contents if engine.block_manager.blocks[b].block_hash is not None]
    assert still  # some cached blocks survived in the cache, so their bytes can be checked
    for block in still:  # the second request read them, dropped or copied them, wrote none
        assert torch.equal(engine.pool.k[:, block], contents[block])
    assert engine.block_manager.num_used_blocks == 0


class LargestKeysFirst(KVPress):
    name = "largest-keys"

    def score(self, keys, first_positions, num_tokens):
        return keys.abs().amax(dim=(1, 2, 3, 4))


def test_a_readers_press_plugs_in_and_bad_presses_are_refused(llm):
    custom = LLM("tiny-py", kv_eviction=LargestKeysFirst(), kv_budget=32)
    out = custom.generate([code(llm, 30)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 and custom.engine.core.num_evicted_blocks > 0
    with pytest.raises(ValueError, match=r"kv_eviction must be one of 'sink-window', 'knorm', 'h2o', 'snapkv', "
                                         r"'random'"):
        LLM("tiny-py", kv_eviction="h3o", kv_budget=64)
    with pytest.raises(ValueError, match=r"kv_budget must be an integer of at least two blocks \(32 tokens\)"):
        LLM("tiny-py", kv_eviction="knorm", kv_budget=20)
    with pytest.raises(ValueError, match="kv_budget needs kv_eviction"):
        LLM("tiny-py", kv_budget=64)

    class Broken(KVPress):
        def score(self, keys, first_positions, num_tokens):
            return torch.zeros(1)

    broken = LLM("tiny-py", kv_eviction=Broken(), kv_budget=32)
    with pytest.raises(ValueError, match=r"Broken.score returned shape \(1,\)"):
        broken.generate([code(llm, 60)], SamplingParams(max_tokens=30, ignore_eos=True))
    assert isinstance(LLM("tiny-py", kv_eviction="sink-window", kv_budget=32).engine.core.press, SinkWindowPress)


@pytest.mark.parametrize(("press", "window"), [("h2o", None), ("snapkv", 16)])
def test_the_attention_a_press_sees_is_hf_attention_summed(llm, press, window):
    """H2O sums the attention every query paid each token (over layers and heads); SnapKV only the
    prompt's last ``window`` queries'. Checked against HF's eager attention weights, no eviction yet."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_models_dir() / "tiny-py", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = engine_for(llm, kv_eviction=press, kv_budget=256, max_num_batched_tokens=16)  # chunked prompt
    prompt = code(llm, 40)
    state = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add(state)
    for _ in range(8):  # three prompt chunks, then five decodes; still running, so still tracked
        engine.step()
    received = engine.core.attention_tracker.received[state.request_id]
    ids = prompt + state.token_ids[:-1]
    with torch.no_grad():
        weights = torch.stack(hf(torch.tensor([ids]), output_attentions=True).attentions)[:, 0]  # (L, H, q, k)
    queries = slice(len(prompt) - window, len(prompt)) if window else slice(None)
    want = weights[:, :, queries].sum(dim=(0, 1, 2))
    assert len(ids) > len(prompt) and received.numel() <= len(ids)
    torch.testing.assert_close(received, want[:received.numel()], atol=1e-4, rtol=1e-4)
    assert float(want[received.numel():].abs().sum()) == 0  # nothing watched reached past the end


@pytest.mark.parametrize("press", ["sink-window", "random", "h2o", "snapkv"])
def test_presses_that_never_read_key_values_get_their_shape_only(llm, press, monkeypatch):
    engine = engine_for(llm, kv_eviction=press, kv_budget=16)
    seen: list[torch.Tensor] = []
    original = engine.core.press.score

    def spy(keys, *args, **kwargs):
        seen.append(keys)
        return original(keys, *args, **kwargs)

    monkeypatch.setattr(engine.core.press, "score", spy)
    monkeypatch.setattr(engine.core.pool, "keys", lambda *_: pytest.fail("dequantized every layer's keys"))
    state = engine.make_request(code(llm, 30), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add(state)
    while not state.finished:
        engine.step()
    assert seen and all(k.device.type == "meta" and k.shape[1:] == (6, 8, 2, 32) for k in seen)
    assert engine.core.num_evicted_blocks > 0


def test_compaction_packs_the_kept_slots_frees_whole_blocks_and_copies_shared_ones():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    alloc, other = BlockAllocation(), BlockAllocation()
    assert bm.allocate(alloc, 14)  # blocks 0..3, the last one half full
    table = list(alloc.block_table)
    shared = bm.pin([table[1]])  # someone else holds block 1
    keep = [0, 1, 2, 3, 4, 6, 9, 13]  # drop 5, 7, 8, 10, 11, 12
    moves = bm.compact(alloc, keep, 14)
    assert len(alloc.block_table) == 2 and alloc.block_table[0] == table[0]  # untouched before the first drop
    assert alloc.block_table[1] != table[1] and bm.blocks[table[1]].ref_count == 1  # copied, not written
    # Every slot of the rewritten block comes from its kept token, unmoved ones included.
    assert moves == [(table[1] * 4 + 0, alloc.block_table[1] * 4 + 0), (table[1] * 4 + 2, alloc.block_table[1] * 4 + 1),
                     (table[2] * 4 + 1, alloc.block_table[1] * 4 + 2), (table[3] * 4 + 1, alloc.block_table[1] * 4 + 3)]
    assert alloc.num_dropped_tokens == 6 and alloc.token_positions == keep
    assert alloc.cache_position(8) == 14  # a token computed after the compaction
    assert bm.num_free_blocks == 10 - 2 - 1  # two kept blocks and the other holder's
    bm.free_blocks(alloc)
    bm.free_blocks(shared)
    assert bm.num_free_blocks == 10 and alloc.token_positions is None
    assert bm.allocate(other, 40) and bm.compact(other, [0, 5], 40) is not None
    full = BlockAllocation()
    bm2 = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    assert bm2.allocate(full, 8)
    pin = bm2.pin(list(full.block_table))
    assert bm2.compact(full, [0, 2, 3, 4, 5, 6, 7], 8) is None and len(full.block_table) == 2  # no room to copy
    bm2.free_blocks(pin)


def test_token_eviction_is_refused_for_kivi_and_named():
    with pytest.raises(ValueError, match="kv_eviction_granularity must be 'block' or 'token'"):
        LLM("tiny-py", kv_eviction="knorm", kv_budget=32, kv_eviction_granularity="page")
    with pytest.raises(ValueError, match="KIVI"):
        LLM("tiny-py", kv_eviction="knorm", kv_budget=32, kv_eviction_granularity="token", kv_cache_dtype="int4")


def test_moving_slots_moves_codes_with_their_scales_and_reads_before_writing():
    from minipd.kv.paged_pool import PagedKVPool
    from minipd.kv.spec import KVSpec

    pool = PagedKVPool(KVSpec(2, 4, 2, 8, torch.int8, (4, 2), torch.float16, "int8"), 3, "cpu")
    pool.k.random_(-100, 100)
    pool.v.random_(-100, 100)
    pool.k_scale.uniform_(0.1, 1)
    pool.v_scale.uniform_(0.1, 1)
    before = [t.clone() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)]
    moves = [(5, 1), (1, 2), (9, 5)]  # slot 1 is read before it is overwritten
    pool.move_slots(moves)
    for now, old in zip((pool.k, pool.v, pool.k_scale, pool.v_scale), before, strict=True):
        flat_now, flat_old = now.flatten(1, 2), old.flatten(1, 2)
        for src, dst in moves:
            assert torch.equal(flat_now[:, dst], flat_old[:, src])
        untouched = [s for s in range(12) if s not in {d for _, d in moves}]
        assert torch.equal(flat_now[:, untouched], flat_old[:, untouched])
