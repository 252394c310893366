"""Quantized KV caches (``kv_cache_dtype="int8"`` / ``"fp8"``): the codes' error bounds, the paged
kernels reading quantized blocks exactly as they read the dequantized values, the bytes counted with
their scales, and the engine's invariants (chunking, prefix caching, preemption, snapshots) holding on
a quantized pool."""

from __future__ import annotations

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.kernels.kv_store import store_kv_torch
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from minipd.kv.paged_pool import PagedKVPool
from minipd.kv.quant import FORMATS, fake_quantize
from minipd.kv.spec import KV_CACHE_DTYPES, KVSpec

QUANTIZED = ["int8", "fp8", "int4_per_token", "int4"]
#: The formats with a scale per token for K and V alike (KIVI's "int4" scales K per channel per block).
PER_TOKEN = ["int8", "fp8", "int4_per_token"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py")


def activations(n: int = 64, heads: int = 2, dim: int = 32, seed: int = 0) -> torch.Tensor:
    """K-like rows: mostly small values, a few outlier channels, one all-zero row and one tiny row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=gen)
    x[:, :, 3] *= 20  # outlier channels, as real K caches have
    x[5] = 0
    x[6] = 1e-9
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_codes_round_trip_within_the_formats_error_bound(name):
    fmt = FORMATS[name]
    x = activations()
    codes, scales = fmt.quantize(x)
    assert codes.dtype == fmt.storage and codes.shape == (*x.shape[:-1], x.shape[-1] // fmt.pack)
    assert scales.dtype == torch.float16 and scales.shape == x.shape[:-1]
    back = fmt.dequantize(codes, scales, torch.float32)
    step = scales.float().unsqueeze(-1)
    err = (back - x).abs()
    if name != "fp8":
        assert bool((err <= 0.5 * step + 1e-12).all())  # half a code step: rounding to the nearest
    else:  # e4m3: 3 mantissa bits, so at most 2^-4 relative; below 2^-6, subnormal steps of 2^-9
        assert bool((err <= 2.0**-4 * x.abs() + 2.0**-10 * step + 1e-12).all())
    assert bool((back[5] == 0).all())
    # The largest magnitude of every row maps to (about) the largest code.
    assert torch.allclose(back.abs().amax(-1)[7:], x.abs().amax(-1)[7:], rtol=2e-3)
    # Far below the values' spread, even with outlier channels stretching every row's scale.
    bound = {"int8": 5e-4, "fp8": 5e-3}.get(name, 0.2)
    assert (err.pow(2).mean() / x.pow(2).mean()).item() < bound


def test_per_channel_key_codes_round_trip_and_beat_per_token_ones_on_outlier_channels():
    """KIVI's K recipe: one scale per channel over a block. Every value is within half a step of its
    channel's scale, and with outlier channels the error is a third of per-token int4's."""
    fmt = FORMATS["int4"]
    blocks = activations(n=64).view(4, 16, 2, 32)  # 4 blocks of 16 tokens
    codes, scales = fmt.quantize_channels(blocks)
    assert codes.shape == (4, 16, 2, 16) and scales.shape == (4, 2, 32) and scales.dtype == torch.float16
    back = fmt.dequantize_channels(codes, scales, torch.float32)
    assert bool(((back - blocks).abs() <= 0.5 * scales.float().unsqueeze(1) + 1e-12).all())
    per_token = fake_quantize(blocks, "int4_per_token")
    channel_err, token_err = (back - blocks).pow(2).mean(), (per_token - blocks).pow(2).mean()
    assert channel_err < 0.4 * token_err  # 0.29x here


def quantized_and_reference_pools(name: str, rows: int = 70, seed: int = 1):
    """A quantized pool and a float pool holding the same K/V after a round trip through the codes."""
    spec = KVSpec(1, 8, 2, 32, FORMATS[name].storage, (8, 2), torch.float16, name)
    quant = PagedKVPool(spec, 16, "cpu")
    plain = PagedKVPool(KVSpec(1, 8, 2, 32, torch.float32), 16, "cpu")
    gen = torch.Generator().manual_seed(seed)
    k, v = activations(rows, seed=seed), torch.randn(rows, 2, 32, generator=gen)
    slots = torch.randperm(16 * 8, generator=gen)[:rows]
    kq, vq = quant.layer(0, torch.float32)
    store_kv_torch(k, v, kq, vq, slots)
    store_kv_torch(fake_quantize(k, name), fake_quantize(v, name), plain.k[0], plain.v[0], slots)
    return quant, plain, slots


@pytest.mark.parametrize("name", PER_TOKEN)
def test_paged_attention_reads_quantized_blocks_as_their_dequantized_values(name):
    quant, plain, _ = quantized_and_reference_pools(name)
    gen = torch.Generator().manual_seed(3)
    tables = torch.stack([torch.randperm(16, generator=gen) for _ in range(3)])
    lens = torch.tensor([37, 128, 9])
    q = torch.randn(3, 8, 32, generator=gen)
    kq, vq = quant.layer(0, torch.float32)
    got = paged_decode_attention_torch(q, kq, vq, tables, lens, 0.2)
    want = paged_decode_attention_torch(q, plain.k[0], plain.v[0], tables, lens, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    qp = torch.randn(20, 8, 32, generator=gen)  # two chunks: 12 queries of a 40-token context, 8 of 100
    starts, contexts = torch.tensor([0, 12, 20]), torch.tensor([40, 100])
    got = paged_prefill_attention_torch(qp, kq, vq, tables[:2], starts, contexts, 0.2)
    want = paged_prefill_attention_torch(qp, plain.k[0], plain.v[0], tables[:2], starts, contexts, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PER_TOKEN)
def test_bytes_are_counted_with_their_scales_and_the_pool_holds_more_tokens(llm, name):
    cfg = llm.config
    memory = 4 * 2**20
    fp16 = LLM("tiny-py", kv_cache_dtype="fp16", kv_cache_memory=memory)
    quant = LLM("tiny-py", kv_cache_dtype=name, kv_cache_memory=memory)
    code_bytes = cfg.head_dim // FORMATS[name].pack
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (code_bytes + 2)  # codes + fp16 scale
    assert quant.engine.core.kv_spec.bytes_per_token == per_token
    assert fp16.engine.core.kv_spec.bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * \
        cfg.head_dim * 2
    pool = quant.engine.pool
    assert pool.nbytes == pool.num_blocks * quant.engine.core.kv_spec.bytes_per_block <= memory
    ratio = quant.kv_capacity_tokens / fp16.kv_capacity_tokens
    assert ratio == pytest.approx((2 * cfg.head_dim) / (code_bytes + 2), rel=0.01)


def test_kivi_bytes_count_per_channel_key_scales_and_the_residual_window_comes_out_of_the_budget(llm):
    cfg, memory = llm.config, 4 * 2**20
    kivi = LLM("tiny-py", kv_cache_dtype="int4", kv_cache_memory=memory, max_num_seqs=8)
    spec, bs, heads, dim = kivi.engine.core.kv_spec, 16, cfg.num_key_value_heads, cfg.head_dim
    # Per layer and token: K and V codes (half a byte a value), V's fp16 scale per head, and K's fp16
    # scales per channel shared by the block's 16 tokens.
    per_token = cfg.num_hidden_layers * heads * (2 * dim // 2 + 2 + 2 * dim / bs)
    assert spec.bytes_per_token == kivi.kv_bytes_per_token == per_token
    pool = kivi.engine.pool
    window = 2 * cfg.num_hidden_layers * 8 * bs * heads * dim * 4  # max_num_seqs fp32 blocks, K and V
    assert pool.num_residual_slots == 8 and pool.residual_k.nbytes + pool.residual_v.nbytes == window
    assert pool.nbytes == pool.num_blocks * spec.bytes_per_block + window <= memory
    assert pool.num_blocks == (memory - window) // spec.bytes_per_block


def test_kivi_blocks_hold_exactly_the_codes_of_their_keys_and_the_filling_block_stays_exact(llm):
    """Layer 0's K/V depend on the tokens alone, so an fp32 engine computes the very values the KIVI
    engine quantizes: every full block must hold their per-channel (K) and per-token (V) codes, bit for
    bit, and the filling block's residual rows must be them exactly; after a snapshot round trip too."""
    fmt = FORMATS["int4"]
    prompt = llm.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = 1\n" * 6)[:45]
    assert len(prompt) == 45
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engines = {name: engine_for(llm, kv_cache_dtype=name, max_num_batched_tokens=20) for name in ("auto", "int4")}
    requests = {}
    for name, engine in engines.items():
        state = engine.make_request(prompt, params, request_id="r")
        engine.add(state)
        for _ in range(5):  # chunks of 20, 20 and 5 prompt tokens, then two decodes: 47 tokens of K/V
            engine.step()
        requests[name] = state.request
    assert requests["int4"].num_computed_tokens == 47
    exact, kivi = engines["auto"].pool, engines["int4"].pool
    table_exact, table_kivi = requests["auto"].blocks.block_table, requests["int4"].blocks.block_table
    for index in range(2):  # the full blocks
        k = exact.k[0, table_exact[index]]
        v = exact.v[0, table_exact[index]]
        codes, scales = fmt.quantize_channels(k)
        assert torch.equal(kivi.k[0, table_kivi[index]], codes) and torch.equal(kivi.k_scale[0, table_kivi[index]],
                                                                                 scales)
        codes, scales = fmt.quantize(v)
        assert torch.equal(kivi.v[0, table_kivi[index]], codes) and torch.equal(kivi.v_scale[0, table_kivi[index]],
                                                                                 scales)
    window = engines["int4"].core.runner.residual
    slot = window.tail["r"]
    assert torch.equal(kivi.residual_k[0, slot, :15], exact.k[0, table_exact[2], :15])
    assert torch.equal(kivi.residual_v[0, slot, :15], exact.v[0, table_exact[2], :15])
    # The filling block's codes are its rows so far, sealed as they stand (what a copy of the block gets).
    codes, _ = fmt.quantize_channels(exact.k[0, table_exact[2]] * (torch.arange(16) < 15)[:, None, None])
    assert torch.equal(kivi.k[0, table_kivi[2]], codes)
    packed = engines["int4"].core.export_kv("r")
    assert packed.tail is not None and torch.equal(packed.tail[0, 0], exact.k[0, table_exact[2], :15])


def engine_for(llm: LLM, **options) -> Engine:
    config = EngineConfig(**{"num_kv_blocks": 128, **options})
    return Engine(llm.model, llm.tokenizer, config, llm.max_model_len, llm.engine.eos_token_ids, seed=0)


def run(engine: Engine, prompts, params) -> list:
    states = [engine.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for state in states:
        engine.add(state)
    for _ in range(3000):
        if all(s.finished for s in states):
            break
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return states


def generate(engine: Engine, prompts, params) -> list[list[int]]:
    return [s.token_ids for s in run(engine, prompts, params)]


def mixed(llm: LLM):
    text = "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser()\n" * 6
    ids = llm.tokenizer.encode(text)
    prompts = [ids[(i * 5) % 40:(i * 5) % 40 + 6 + (i * 11) % 70] for i in range(12)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(12)]
    return prompts, params


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_quantized_pool_gives_the_same_tokens_however_the_work_is_split(llm, name):
    """Per-token scales make a token's codes independent of what else is in its block, so chunked
    prefill, prefix-cache hits and preemption (recomputation) all read the same K/V."""
    prompts, params = mixed(llm)
    whole = generate(engine_for(llm, kv_cache_dtype=name, enable_prefix_caching=False), prompts, params)
    chunked = generate(engine_for(llm, kv_cache_dtype=name, max_num_batched_tokens=24), prompts, params)
    small = engine_for(llm, kv_cache_dtype=name, num_kv_blocks=10)
    preempted = generate(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    if name == "int4":
        # KIVI: a block's rows are read exact until the step that fills it, so where a chunk ends inside
        # a block, the queries before the cut saw exact rows that a whole prefill reads as codes. Greedy
        # tokens stay almost all equal; sampled ones may drift after the first difference.
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        for other in (chunked, preempted):
            same = [a == b for i in greedy for a, b in zip(whole[i], other[i], strict=True)]
            assert sum(same) / len(same) > 0.9
    else:
        assert chunked == whole and preempted == whole
    cached = engine_for(llm, kv_cache_dtype=name)
    generate(cached, prompts, params)
    again = run(cached, prompts, params)  # the second time, prompts hit the prefix cache
    assert [s.token_ids for s in again] == whole
    assert sum(s.metrics.cached_tokens for s in again) > 0


def test_quantized_tokens_stay_close_to_the_full_precision_ones(llm):
    """Not exact (the K/V are rounded), but on this model int8 changes few greedy tokens."""
    prompts, _ = mixed(llm)
    greedy = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * len(prompts)
    full = generate(engine_for(llm), prompts, greedy)
    int8 = generate(engine_for(llm, kv_cache_dtype="int8"), prompts, greedy)
    equal = sum(a == b for x, y in zip(full, int8, strict=True) for a, b in zip(x, y, strict=True))
    assert equal / sum(map(len, full)) > 0.9


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_snapshot_of_a_quantized_pool_resumes_to_the_same_tokens(llm, name, tmp_path):
    prompts, params = mixed(llm)
    expected = generate(engine_for(llm, kv_cache_dtype=name), prompts, params)
    first = engine_for(llm, kv_cache_dtype=name, max_num_batched_tokens=48)
    states = [first.make_request(p, sp, request_id=f"q{i}") for i, (p, sp) in enumerate(zip(prompts, params,
                                                                                          strict=True))]
    for state in states:
        first.add(state)
    for _ in range(4):
        first.step()
    done = {s.request_id: s.token_ids for s in states if s.finished}
    path = first.save_snapshot(tmp_path / "snap")
    resumed = engine_for(llm, kv_cache_dtype=name)
    restored = {i: resumed.processor.states[i] for i in resumed.load_snapshot(path)}
    assert any(s.request.num_external_tokens for s in restored.values())  # they brought their K/V
    for _ in range(3000):
        if all(s.finished for s in restored.values()):
            break
        resumed.step()
    got = {i: s.token_ids for i, s in restored.items()} | done
    assert [got[f"q{i}"] for i in range(len(prompts))] == expected
    other = engine_for(llm, kv_cache_dtype="fp8" if name == "int8" else "int8")
    with pytest.raises(Exception, match="quant"):
        other.load_snapshot(path)


def test_bad_kv_cache_dtypes_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto'.*'int8'.*got 'int3'"):
        LLM("tiny-py", kv_cache_dtype="int3")
    assert set(QUANTIZED) <= set(KV_CACHE_DTYPES) and {"fp16", "bf16"} <= set(KV_CACHE_DTYPES)


def test_kivi_needs_one_residual_slot_per_running_request(llm):
    """Chunks that fill one block and start the next hand the slot on; preempted, finished and recomputed
    requests give theirs back: max_num_seqs slots always suffice."""
    prompts, params = mixed(llm)
    engine = engine_for(llm, kv_cache_dtype="int4", max_num_seqs=3, max_num_batched_tokens=20, num_kv_blocks=12)
    window = engine.core.runner.residual
    states = [engine.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for state in states:
        engine.add(state)
    live_most = 0
    while not all(s.finished for s in states):
        engine.step()
        live = [slot for slot, (r, _) in window.owner.items() if not r.is_finished]
        live_most = max(live_most, len(live))
        assert len(live) <= 3 and len(window.free) + len(window.owner) == 3
    assert engine.scheduler.num_preemptions > 0 and live_most == 3


@pytest.mark.parametrize("name", PER_TOKEN)
def test_a_wire_format_packs_a_float_pool_and_unpacks_its_round_trip(name):
    """kv_transfer_dtype: what the receiver writes is exactly the per-token round trip of what was sent,
    in as many bytes as the codes and scales take, for any run of layers and any blocks."""
    from minipd.pd.kv_layout import QuantizedWire

    spec = KVSpec(3, 8, 2, 32, torch.float32)
    sender, receiver = PagedKVPool(spec, 10, "cpu"), PagedKVPool(spec, 10, "cpu")
    sender.k.normal_()
    sender.v.normal_()
    send, receive = QuantizedWire(sender, name), QuantizedWire(receiver, name)
    blocks, into = torch.tensor([7, 2, 5]), torch.tensor([0, 9, 4])
    payload = send.pack(slice(1, 3), blocks)
    assert payload.dtype == torch.uint8 and payload.numel() == send.size(2, 3)
    assert send.bytes_per_block == 2 * 3 * 8 * 2 * (32 // FORMATS[name].pack + 2)
    receive.unpack(slice(1, 3), into, payload)
    for mine, theirs in ((receiver.k, sender.k), (receiver.v, sender.v)):
        assert torch.equal(mine[1:3, into], fake_quantize(theirs[1:3, blocks], name))
        assert not mine[0].any() and not mine[1:3, [1, 2, 3, 5, 6, 7, 8]].any()  # nothing else written
    with pytest.raises(ValueError, match="already int8"):
        QuantizedWire(PagedKVPool(KVSpec(1, 8, 2, 32, torch.int8, (8, 2), torch.float16, "int8"), 2, "cpu"), name)
