"""Adaptive KV precision (``kv_cache_dtype="adaptive"``): pages split into compressed blocks without
overlap, full-precision requests equal to a float engine's and compressed ones to an int8 engine's, the
switch following the pool's usage with hysteresis, and bad combinations refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.kv.adaptive import AdaptiveBlockManager, AdaptiveKVPool
from minipd.kv.block_manager import BlockAllocation
from minipd.kv.spec import KVSpec


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py")


def test_pages_are_handed_out_whole_or_in_parts_and_come_back_whole():
    bm = AdaptiveBlockManager(num_pages=6, block_size=4, ratio=4, low=0.3, high=0.5)
    full, parts = BlockAllocation(), BlockAllocation()
    assert bm.allocate(full, 12) and full.compressed is False and len(full.block_table) == 3  # 3 of 6 pages
    assert bm.usage == 0.5 and bm.num_free_blocks == 3
    assert bm.allocate(parts, 20) and parts.compressed is True  # usage reached `high`: compressed
    assert full.block_table == [0, 1, 2]
    assert sorted(b // 4 for b in parts.block_table) == [3, 3, 3, 3, 4]  # five parts: one page and a part
    assert bm.num_free_blocks == 1 and bm.usage == pytest.approx((3 + 5 / 4) / 6)
    assert not set(full.block_table) & {b // 4 for b in parts.block_table}  # no page is both
    more = BlockAllocation()
    assert bm.allocate(more, 8) and more.compressed  # two more parts: into the split page first
    assert bm.num_free_blocks == 1
    assert not bm.allocate(BlockAllocation(), 40)  # 10 parts do not fit: 1 open part + 4 in the free page
    bm.free_blocks(parts)
    bm.free_blocks(more)
    assert parts.compressed is None and bm.num_free_blocks == 3 and bm.usage == 0.5
    bm.free_blocks(full)
    assert bm.num_free_blocks == 6 and bm.usage == 0.0 and not bm.open_parts and not bm.used_parts


def test_the_switch_has_hysteresis_and_is_counted():
    bm = AdaptiveBlockManager(num_pages=10, block_size=1, ratio=2, low=0.3, high=0.6)
    held = []
    for _ in range(6):
        held.append(BlockAllocation())
        bm.allocate(held[-1], 1)
    assert [a.compressed for a in held] == [False] * 6 and bm.usage == 0.6
    held.append(BlockAllocation())
    bm.allocate(held[-1], 1)
    assert held[-1].compressed and bm.compressing and bm.num_switches == 1
    for alloc in held[:3]:  # usage 0.35: above `low`, so still compressing
        bm.free_blocks(alloc)
    fresh = BlockAllocation()
    bm.allocate(fresh, 1)
    assert fresh.compressed and bm.num_switches == 1
    for alloc in held[3:5]:  # usage below `low`: full precision again
        bm.free_blocks(alloc)
    bm.free_blocks(fresh)
    back = BlockAllocation()
    bm.allocate(back, 1)
    assert back.compressed is False and bm.num_switches == 2


def test_random_allocations_never_share_a_byte():
    rng = random.Random(0)
    bm = AdaptiveBlockManager(num_pages=12, block_size=1, ratio=4, low=0.2, high=0.4)
    live: list[BlockAllocation] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            bm.free_blocks(live.pop(rng.randrange(len(live))))
        else:
            alloc = BlockAllocation()
            if bm.allocate(alloc, rng.randint(1, 6)):
                live.append(alloc)
        bytes_used = [(b, 1) if not a.compressed else (b // 4, 4) for a in live for b in a.block_table]
        pages_full = [p for p, r in bytes_used if r == 1]
        parts = [b for a in live if a.compressed for b in a.block_table]
        assert len(set(parts)) == len(parts) and len(set(pages_full)) == len(pages_full)
        assert not set(pages_full) & {b // 4 for b in parts}
        assert not set(bm.free_pages) & (set(pages_full) | {b // 4 for b in parts})
        assert len(set(bm.free_pages)) == len(bm.free_pages)
        assert bm.usage == pytest.approx((len(pages_full) + len(parts) / 4) / 12)


def test_compressed_blocks_are_the_bytes_of_their_page(llm):
    cfg = llm.config
    full = KVSpec.from_name(cfg, 16, "auto", torch.float32)
    int8 = KVSpec.from_name(cfg, 16, "int8", torch.float32)
    pool = AdaptiveKVPool(full, 5, "cpu", int8)
    assert pool.ratio == 4
    codes, _ = pool.compressed_layer(2, torch.float32)
    codes.codes[4 * 3 + 1].fill_(7)  # page 3, part 1
    changed = (pool.k[2] != 0).flatten(1).any(dim=1)
    assert changed.tolist() == [False, False, False, True, False] and not pool.k[[0, 1, 3, 4, 5]].any()
    page_bytes = AdaptiveKVPool.page_bytes(full, int8)
    assert page_bytes == full.bytes_per_block + 4 * (int8.bytes_per_block - cfg.num_hidden_layers * 2 * 16 *
                                                     cfg.num_key_value_heads * cfg.head_dim)
    assert pool.nbytes == 5 * page_bytes


def engine_for(llm: LLM, **options) -> Engine:
    config = EngineConfig(**{"num_kv_blocks": 60, "enable_prefix_caching": False, **options})
    return Engine(llm.model, llm.tokenizer, config, llm.max_model_len, llm.engine.eos_token_ids, seed=0)


def prompts(llm: LLM, n: int = 8) -> list[list[int]]:
    ids = llm.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = build()\n" * 10)
    return [ids[i * 5:i * 5 + 20 + 7 * i] for i in range(n)]


def run(engine: Engine, prompt_list, params) -> tuple[list[list[int]], list[bool]]:
    states = [engine.make_request(p, params) for p in prompt_list]
    formats: dict[int, bool] = {}  # (a plain pool never sets a format: False)
    for state in states:
        engine.add(state)
    while not all(s.finished for s in states):
        engine.step()
        for i, s in enumerate(states):
            if s.request is not None and s.request.blocks.compressed is not None:
                formats.setdefault(i, s.request.blocks.compressed)
    return [s.token_ids for s in states], [formats.get(i, False) for i in range(len(states))]


def test_each_request_is_exactly_the_engine_of_its_format(llm):
    """Full-precision requests read and write the pages as floats: the tokens of a float engine; compressed
    ones as int8 blocks: the tokens of an int8 engine. Both kinds share a step and a pool."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = prompts(llm)
    floats = run(engine_for(llm), batch, params)[0]
    int8 = run(engine_for(llm, kv_cache_dtype="int8"), batch, params)[0]
    engine = engine_for(llm, kv_cache_dtype="adaptive", kv_adaptive_thresholds=(0.1, 0.15))
    tokens, compressed = run(engine, batch, params)
    assert 0 < sum(compressed) < len(batch)  # a mix
    for got, full, q, is_compressed in zip(tokens, floats, int8, compressed, strict=True):
        assert got == (q if is_compressed else full)
    stats = list(engine.core.step_stats)
    assert any(s.kv_compressing for s in stats) and stats[-1].kv_format_switches >= 1
    assert max(s.num_compressed_running for s in stats) > 0
    assert engine.core.block_manager.usage == 0.0  # everything came back


def test_under_pressure_adaptive_holds_more_and_preempts_less_than_full_precision(llm):
    """A pool that fits about seven of these requests in full precision: adaptive compresses newcomers
    once it is half used, and compresses a running request in place rather than preempt one, so more run
    at once, (almost) nothing is recomputed, and the first requests keep full precision."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    batch = prompts(llm, 12)
    results = {}
    for name, options in {"auto": {}, "adaptive": {"kv_cache_dtype": "adaptive",
                                                   "kv_adaptive_thresholds": (0.3, 0.5)}}.items():
        engine = engine_for(llm, num_kv_blocks=24, **options)
        tokens, compressed = run(engine, batch, params)
        stats = list(engine.core.step_stats)
        results[name] = (tokens, engine.scheduler.num_preemptions, max(s.num_running for s in stats), len(stats),
                         compressed, stats[-1].kv_compressions)
    auto, adaptive = results["auto"], results["adaptive"]
    assert auto[1] >= 5 and adaptive[1] <= 1  # preemptions
    assert adaptive[2] > auto[2] and adaptive[3] < 0.5 * auto[3]  # more running at once, far fewer steps
    assert adaptive[5] > 0  # running requests were compressed to make room
    untouched = [i for i, c in enumerate(adaptive[4]) if not c][:2]  # admitted first, in full precision
    assert untouched and all(adaptive[0][i][:16] == auto[0][i][:16] for i in untouched)


def test_bad_adaptive_options_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        EngineConfig(kv_cache_dtype="adaptive")
    with pytest.raises(ValueError, match="kv_adaptive_format must be one of 'int8', 'fp8', 'int4_per_token', got"):
        EngineConfig(kv_cache_dtype="adaptive", enable_prefix_caching=False, kv_adaptive_format="int4")
    with pytest.raises(ValueError, match=r"kv_adaptive_thresholds must be \(low, high\)"):
        EngineConfig(kv_cache_dtype="adaptive", enable_prefix_caching=False, kv_adaptive_thresholds=(0.8, 0.2))
    with pytest.raises(ValueError, match="kv_eviction"):
        EngineConfig(kv_cache_dtype="adaptive", enable_prefix_caching=False, kv_eviction="h2o", kv_budget=64)
    from minipd.pd import DisaggregatedLLM

    with pytest.raises(ValueError, match="adaptive"):
        DisaggregatedLLM("tiny-py", kv_cache_dtype="adaptive", enable_prefix_caching=False)
    adaptive = LLM("tiny-py", kv_cache_dtype="adaptive", enable_prefix_caching=False)
    assert len(adaptive.generate("def f(x):", SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_compressing_a_request_in_place_keeps_its_values_to_int8_precision(llm):
    """Its pages are freed and its blocks re-taken as parts, possibly in those very pages: the values are
    copied out first, so each block reads back as its int8 round trip."""
    from minipd.kv.quant import fake_quantize

    cfg = llm.config
    full = KVSpec.from_name(cfg, 16, "auto", torch.float32)
    pool = AdaptiveKVPool(full, 4, "cpu", KVSpec.from_name(cfg, 16, "int8", torch.float32))
    bm = AdaptiveBlockManager(4, 16, pool.ratio, 0.9, 1.0)
    alloc = BlockAllocation()
    assert bm.allocate(alloc, 48) and alloc.compressed is False and alloc.block_table == [0, 1, 2]
    torch.manual_seed(0)
    pool.k.normal_()
    pool.v.normal_()
    before_k, before_v = pool.k[:, :3].clone(), pool.v[:, :3].clone()
    pages, parts = bm.compress(alloc)
    pool.compress_pages(pages, parts)
    assert pages == [0, 1, 2] and alloc.compressed
    assert len({p // 4 for p in parts}) == 1 and parts[0] // 4 in pages  # all three in one of the freed pages
    assert bm.num_free_blocks == 3 and bm.num_compressions == 1
    for layer in range(cfg.num_hidden_layers):
        k, v = pool.compressed_layer(layer, torch.float32)
        index = torch.tensor(parts)
        assert torch.equal(k[index], fake_quantize(before_k[layer], "int8"))
        assert torch.equal(v[index], fake_quantize(before_v[layer], "int8"))
    with pytest.raises(ValueError, match="only a full-precision request"):
        bm.compress(alloc)
