"""The compiled static-shape decode step (``compile_decode=True``): its attention against the paged
reference, the engine's outputs against the eager engine, what it refuses, and its buckets.

Compiling costs ~10-30 s per bucket on a 2-core CPU, so these tests keep to a few small buckets.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from helpers import make_hf_model, need_cpu_kernel

from minipd import LLM, SamplingParams
from minipd.engine.compiled_decode import bucket_sizes, decode_attention_with_new
from minipd.engine.config import EngineConfig
from minipd.kernels.paged_attention import paged_decode_attention_torch

PROMPTS = ["def fib(n):", "import os\nclass Foo:", "for i in range(10):\n    print("]


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, -1), (8, 2, -1), (8, 2, 5)])
def test_attention_with_the_new_token_supplied_matches_the_paged_reference(heads, kv_heads, window):
    torch.manual_seed(0)
    block_size, dim, num_blocks = 8, 16, 24
    lens = torch.tensor([1, 9, 17, 30])  # one row with nothing cached, one just past a block edge
    batch = len(lens)
    k_cache, v_cache = torch.randn(num_blocks, block_size, kv_heads, dim), torch.randn(num_blocks, block_size,
                                                                                       kv_heads, dim)
    # Shuffled, non-contiguous blocks; the table is wider than any sequence needs (padding with block 0).
    tables = torch.zeros(batch, 6, dtype=torch.int32)
    ids = torch.randperm(num_blocks - 1) + 1
    for b, n in enumerate(lens.tolist()):
        blocks = -(-n // block_size)
        tables[b, :blocks] = ids[4 * b:4 * b + blocks]
    q, k_new, v_new = torch.randn(batch, heads, dim), torch.randn(batch, kv_heads, dim), torch.randn(batch, kv_heads,
                                                                                                     dim)
    got = decode_attention_with_new(q, k_new, v_new, k_cache, v_cache, tables, lens.to(torch.int32), 0.25, window)
    # The reference reads the new token from the pool: store it there first (the compiled step does it after).
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens.tolist()):
        block, offset = tables[b, (n - 1) // block_size], (n - 1) % block_size
        k_ref[block, offset], v_ref[block, offset] = k_new[b], v_new[b]
    want = paged_decode_attention_torch(q, k_ref, v_ref, tables, lens, 0.25, None if window < 0 else window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The pool itself was only read.
    assert not torch.equal(k_cache, k_ref)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(30) == [1, 2, 4, 8, 12, 16, 24, 30]
    assert bucket_sizes(128)[-3:] == [112, 120, 128] and len(bucket_sizes(128)) == 20


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("kernel_backend", ["torch", "cpu"])
def test_compiled_decode_gives_the_eager_greedy_tokens(kernel_backend):
    if kernel_backend == "cpu":
        need_cpu_kernel()
    # Different lengths: the batch shrinks from 3 to 1, every step padded into the one bucket of 4.
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 12, 5)]
    options = dict(kernel_backend=kernel_backend, max_model_len=64, max_num_seqs=4)
    want = _tokens(LLM("tiny-py", **options), params)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), **options)
    assert _tokens(llm, params) == want
    compiled = llm.engine.core.runner.compiled
    assert compiled is not None and compiled.compiled and all(b == 4 for b, _ in compiled.compiled)
    # A batch wider than the largest bucket runs eagerly, and is still right.
    wide = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3
    narrow = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(1,), **options)
    assert _tokens(narrow, wide) == _tokens(LLM("tiny-py", **options), wide)


@pytest.mark.parametrize("long_lived", [False, True])
def test_compiled_decode_samples_and_reports_logprobs_like_eager(long_lived):
    # A long-lived engine's programs have a C++ wrapper (inductor's cpp_wrapper), the others a Python one.
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7, logprobs=2)
    options = dict(max_model_len=64, max_num_seqs=4, compile_batch_sizes=(4,), long_lived=long_lived)
    eager = LLM("tiny-py", max_model_len=64, max_num_seqs=4).generate(PROMPTS[:2], params)
    llm = LLM("tiny-py", compile_decode=True, **options)
    compiled = llm.generate(PROMPTS[:2], params)
    _assert_same_outputs(compiled, eager, 1e-4)
    program = llm.engine.core.runner.compiled
    assert program.compiled and program.cpp_wrapper is long_lived


def _assert_same_outputs(got, want, tolerance: float) -> None:
    """The same tokens, and each step's log-probabilities of the same candidates within ``tolerance``."""
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            for token, value in step_a.items():
                assert value == pytest.approx(step_b[token], abs=tolerance)


@pytest.mark.parametrize("kernel_backend,buckets", [
    ("torch", {(1, 1), (1, 2), (2, 1), (2, 2)}),  # the reference gathers the padded width: widths bucketed
    ("cpu", {(1, 2), (2, 2)}),  # the kernel reads up to each length: every table padded to the widest
])
def test_warm_up_compiles_every_bucket(tmp_path, kernel_backend, buckets):

    if kernel_backend == "cpu":
        need_cpu_kernel()
    make_hf_model(tmp_path, "qwen3", max_position_embeddings=64)  # q/k norms, untied head
    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    llm = LLM(str(tmp_path), compile_decode=True, compile_warmup=True, compile_batch_sizes=(1, 2), block_size=16,
              max_model_len=32, max_num_seqs=2, kernel_backend=kernel_backend)
    compiled = llm.engine.core.runner.compiled
    assert compiled.compiled == buckets
    # Dynamo's limits were raised only while the buckets were traced, not for the rest of the process.
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit) == limits
    # Warm-up wrote only dummy rows: outputs are the eager engine's, and nothing is compiled again.
    from torch._dynamo.utils import counters

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(tmp_path), max_model_len=32).generate([[5, 6, 7], [9, 1]], params)]
    compiles = counters["stats"]["calls_captured"]
    assert [o.token_ids for o in llm.generate([[5, 6, 7], [9, 1]], params)] == want
    assert counters["stats"]["calls_captured"] == compiles


@pytest.mark.parametrize("options,message", [
    (dict(compile_decode="yes"), "compile_decode must be True, False or 'auto'"),
    (dict(compile_decode=1), "compile_decode must be True, False or 'auto'"),
    (dict(long_lived="yes"), "long_lived must be True or False"),
    (dict(compile_decode=False, compile_warmup=True), "compile_warmup compiles the decode buckets"),
    (dict(compile_decode=True, compile_batch_sizes=(0, 4)), "compile_batch_sizes must be"),
    (dict(compile_decode=True, compile_batch_sizes=(4,), max_num_seqs=2), "compile_batch_sizes must be"),
])
def test_bad_compile_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_compile_decode_refuses_what_it_does_not_cover(tmp_path):
    with pytest.raises(ValueError, match="compile_decode does not cover record_routing: pass compile_decode=False"):
        LLM("tiny-py-moe", compile_decode=True, record_routing=True)
    with pytest.raises(ValueError, match="compile_decode does not cover moe_capacity_factor"):
        LLM("tiny-py-moe", compile_decode=True, moe_capacity_factor=1.25)


def test_compiled_decode_covers_mixture_of_experts():
    # A compiled MoE step runs every expert on every row and keeps each token's chosen ones (no shape depends
    # on the routing): same greedy tokens and log-probabilities as the eager engine, which runs them by expert.
    from minipd.moe.dispatch import LocalDispatcher
    from minipd.moe.experts import StackedExperts

    torch.manual_seed(0)
    experts = StackedExperts(8, 32, 48)
    with torch.no_grad():
        for weight in experts.parameters():
            weight.normal_()
        rows, weights = torch.randn(5, 32), torch.rand(5, 2)
        ids = torch.stack([torch.randperm(8)[:2] for _ in range(5)])
        torch.testing.assert_close(experts.every_expert(rows, weights, ids),
                                   LocalDispatcher(8).run(rows, weights, ids, experts), rtol=1e-5, atol=1e-3)
    options = dict(max_model_len=64, max_num_seqs=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (24, 12, 5)]
    eager = LLM("tiny-py-moe", **options).generate(PROMPTS, params)
    llm = LLM("tiny-py-moe", compile_decode=True, compile_batch_sizes=(4,), **options)
    compiled = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    for a, b in zip(compiled, eager, strict=True):
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert all(step_a[t] == pytest.approx(step_b[t], abs=1e-4) for t in step_a)
    assert llm.engine.core.runner.compiled.compiled == {(4, 4)}
    # Past 16 rows running every expert costs more than it saves: the default buckets of an MoE model stop there.
    wide = LLM("tiny-py-moe", compile_decode=True, max_num_seqs=64, max_model_len=64).engine.core.runner.compiled
    assert max(wide.batch_sizes) == 16


def test_buckets_run_on_the_threads_they_were_compiled_for():
    # A CPU program is built for the thread count it is traced under; compiled steps all run on the engine's
    # count (eager ones of few tokens on one thread), so after warm-up no step traces a program again.
    from torch._dynamo.utils import counters

    need_cpu_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM("tiny-py", compile_decode=True, compile_warmup=True, compile_batch_sizes=(1, 8), max_model_len=64,
                  max_num_seqs=8)
        assert torch.get_num_threads() == 2  # warm-up gave the caller's count back
        compiles = counters["stats"]["calls_captured"]
        # Three sequences run in the bucket of 8, the last one alone in the bucket of 1 (both on 2 threads).
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 6, 14)]
        llm.generate(PROMPTS, params)
        assert counters["stats"]["calls_captured"] == compiles
        assert llm.engine.core.runner.compiled.compiled == {(1, 4), (8, 4)}
    finally:
        torch.set_num_threads(before)


def test_a_refused_recompilation_turns_compiled_decode_off_and_the_step_runs_eagerly(caplog):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-py", max_model_len=64).generate(PROMPTS, params)]
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), max_model_len=64, max_num_seqs=4)
    runner = llm.engine.core.runner

    def refuse(*args, **kwargs):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached")

    runner.compiled.run = refuse  # what the compiler raises past its limit, before anything is written
    with caplog.at_level("WARNING", logger="minipd"):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    assert runner.compiled is None and "compile_decode turned off" in caplog.text


@pytest.mark.parametrize(("kernel_backend", "kv_cache_dtype"), [("cpu", "fp16"), ("cpu", "bf16"), ("torch", "fp16")])
def test_compiled_decode_runs_over_a_half_precision_pool_like_eager(kernel_backend, kv_cache_dtype):
    """An fp32 model over an fp16/bf16 pool: the new rows the program passes are rounded as the pool keeps them, so
    it attends to what an eager step reads back after storing them (the C++ kernel reads the pool in place)."""
    if kernel_backend == "cpu":
        need_cpu_kernel()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (16, 7, 3)]
    options = dict(kernel_backend=kernel_backend, kv_cache_dtype=kv_cache_dtype, max_model_len=64, max_num_seqs=4)
    want = LLM("tiny-py", **options).generate(PROMPTS, params)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), **options)
    assert llm.engine.core._compiled_attention_is_the_kernel() == (kernel_backend == "cpu")
    _assert_same_outputs(llm.generate(PROMPTS, params), want, 1e-3)  # unrounded new rows: 2.4e-3 off (fp16)
    assert llm.engine.core.runner.compiled.compiled  # the compiled program ran (it did not fall back)


def test_compiled_decode_of_a_bf16_model_calls_the_kernels_over_its_own_pool_like_eager():
    """A model loaded in bf16: its pool is bf16 too, and the program calls the C++ decode kernel on it (rows widened
    to fp32 as read) and the panel linears on bf16 weights, as the eager step does. bf16 rounds every activation:
    the greedy tokens agree, the log-probabilities to bf16's precision."""
    need_cpu_kernel()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (16, 7, 3)]
    options = dict(dtype="bfloat16", max_model_len=64, max_num_seqs=4)
    eager = LLM("tiny-py", **options)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), **options)
    assert llm.engine.core._compiled_attention_is_the_kernel() and llm.engine.core.linear_backend == "cpu"
    _assert_same_outputs(llm.generate(PROMPTS, params), eager.generate(PROMPTS, params), 0.1)
    assert llm.engine.core.runner.compiled.compiled  # the compiled program ran (it did not fall back)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4_per_token"])
def test_compiled_decode_reads_and_writes_a_quantized_pool_like_eager(kv_cache_dtype):
    """Per-token formats: the program quantizes each new row and attends to it as read back from its codes, as an
    eager step attends to the row it has just stored; the pool gets the same codes and scales."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (16, 7, 3)]
    _compiled_pool_matches_eager(dict(kv_cache_dtype=kv_cache_dtype, max_model_len=64, max_num_seqs=4,
                                      num_kv_blocks=32), params, scale_atol=0)


def _compiled_pool_matches_eager(options: dict, params: list, scale_atol: float):
    """Compiled and eager engines on PROMPTS: the same outputs, and pools with the same codes and scales (the same
    blocks are used in the same order; a row whose float K/V differ in the last bits between the two programs
    may round one code the other way). Returns both pools (compiled, eager)."""
    eager = LLM("tiny-py", **options)
    want = eager.generate(PROMPTS, params)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), **options)
    got = llm.generate(PROMPTS, params)
    assert llm.engine.core.runner.compiled.compiled  # the compiled program ran (it did not fall back)
    _assert_same_outputs(got, want, 1e-3)
    mine, theirs = llm.engine.core.pool, eager.engine.core.pool
    for codes, want_codes in ((mine.k, theirs.k), (mine.v, theirs.v)):
        assert (codes == want_codes).float().mean() > 0.999
    for scales, want_scales in ((mine.k_scale, theirs.k_scale), (mine.v_scale, theirs.v_scale)):
        torch.testing.assert_close(scales.float(), want_scales.float(), rtol=2e-3, atol=scale_atol)
    return mine, theirs


@pytest.mark.parametrize("block_size", [8, 1])
def test_compiled_decode_covers_kivi_int4(block_size):
    """KIVI's int4 cache: new rows go to the residual window after the program, a block a row fills is sealed
    into per-channel codes, and the program attends to it as sealed (the new token too), as an eager step does
    once it has stored; the pools end with the same codes, scales and window. (block_size=1: every token is a
    block written whole as codes, none goes to the window.)"""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (21, 9, 14)]
    options = dict(kv_cache_dtype="int4", max_model_len=64, max_num_seqs=4, num_kv_blocks=48 * 8 // block_size,
                   block_size=block_size, enable_prefix_caching=False)
    mine, theirs = _compiled_pool_matches_eager(options, params, scale_atol=1e-6)
    for window, want_window in ((mine.residual_k, theirs.residual_k), (mine.residual_v, theirs.residual_v)):
        torch.testing.assert_close(window, want_window, rtol=1e-4, atol=1e-4)


def test_compiled_decode_covers_adaptive_precision():
    """Adaptive KV precision: full-precision and compressed requests share compiled steps (each row reads the pages
    in its own format; a compressed row's new K/V are quantized in the program), with the eager engine's tokens and
    log-probabilities."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (20, 14, 9, 16)]
    prompts = [*PROMPTS, "while True:\n    x = "]
    options = dict(kv_cache_dtype="adaptive", kv_adaptive_thresholds=(0.1, 0.15), enable_prefix_caching=False,
                   max_model_len=64, max_num_seqs=4, num_kv_blocks=12)
    eager = LLM("tiny-py", **options)
    want = eager.generate(prompts, params)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), **options)
    compiled = llm.engine.core.runner.compiled
    mixes: list[tuple[int, int]] = []  # (rows, compressed rows) of every compiled step
    run = compiled.run

    def watched(input_ids, *args, compressed_rows=0, **kwargs):
        mixes.append((len(input_ids), compressed_rows))
        return run(input_ids, *args, compressed_rows=compressed_rows, **kwargs)

    compiled.run = watched
    got = llm.generate(prompts, params)
    _assert_same_outputs(got, want, 1e-3)
    assert any(0 < compressed < rows for rows, compressed in mixes)  # both formats in one compiled step
    assert max(s.num_compressed_running for s in llm.engine.core.step_stats) > 0


@pytest.mark.parametrize("absorb", [True, False])
def test_compiled_decode_covers_multi_head_latent_attention(tmp_path, monkeypatch, absorb):
    # DeepSeek-V3's shape (tiny, random): latent rows in the pool, absorbed or expanded decode, MoE layers.
    from minipd.layers.mla import MultiHeadLatentAttention

    monkeypatch.setattr(MultiHeadLatentAttention, "absorb_decode", absorb)
    make_hf_model(tmp_path, "deepseek_v3")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (12, 5)]
    options = dict(max_model_len=64, max_num_seqs=2, block_size=8)
    prompts = [[5, 9, 14, 3, 7], [11, 2, 8, 30, 4, 6, 19, 21, 1, 13]]
    want = LLM(str(tmp_path), **options).generate(prompts, params)
    llm = LLM(str(tmp_path), compile_decode=True, compile_batch_sizes=(2,), **options)
    assert "latent" not in llm.describe()["compile_decode"]
    got = llm.generate(prompts, params)
    assert llm.engine.core.runner.compiled.compiled
    _assert_same_outputs(got, want, 1e-4)


@pytest.mark.parametrize("press", ["sink-window", "knorm", "h2o", "snapkv"])
def test_compiled_decode_runs_beside_eviction_presses(press, monkeypatch):
    # Every press evicts between steps: the compiled step reads what it left. H2O and SnapKV score by received
    # attention: the program returns each layer's queries and the press's tracker sees them after the step.
    from minipd.engine.compiled_decode import CompiledDecode

    need_cpu_kernel()
    observed = []
    observe = CompiledDecode.observe
    monkeypatch.setattr(CompiledDecode, "observe", lambda self, observer: observed.append(observe(self, observer)))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 25, 9)]
    options = dict(max_model_len=128, max_num_seqs=4, kv_eviction=press, kv_budget=24, block_size=4)
    eager = LLM("tiny-py", **options)
    want = _tokens(eager, params)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4,), **options)
    assert _tokens(llm, params) == want
    assert (len(observed) > 0) == (press in ("h2o", "snapkv"))  # the tracker saw the compiled steps' queries
    core = llm.engine.core
    assert core.runner.compiled.compiled and core.num_evicted_blocks == eager.engine.core.num_evicted_blocks > 0
    assert core.runner.compiled.keep_queries == (press in ("h2o", "snapkv"))


def test_compile_decode_with_expert_parallelism_is_refused_before_any_rank_starts(monkeypatch):
    import minipd.engine.expert_ranks as ranks

    def no_ranks(*args, **kwargs):
        raise AssertionError("an expert-parallel rank was started")

    monkeypatch.setattr(ranks, "RankProcess", no_ranks)
    with pytest.raises(ValueError, match=r"compile_decode.*expert_parallel_size"):
        LLM("tiny-py-moe", compile_decode=True, expert_parallel_size=2)


def test_auto_compiles_a_long_lived_engine_in_the_background_and_no_step_waits_for_it():
    # compile_decode="auto" (the default) on a long-lived engine: programs are compiled in a background thread,
    # smallest first; steps whose program is not ready run eagerly meanwhile. Outputs are the eager engine's
    # before, during and after, and once every program is ready no step traces again.
    from torch._dynamo.utils import counters

    need_cpu_kernel()
    options = dict(max_model_len=64, max_num_seqs=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 9, 4)]
    want = _tokens(LLM("tiny-py", **options), params)
    llm = LLM("tiny-py", long_lived=True, compile_batch_sizes=(1, 4), **options)
    compiled = llm.engine.core.runner.compiled
    assert compiled is not None and compiled.ready is not None
    assert compiled.cpp_wrapper  # a long-lived engine's programs call their kernels from C++
    assert "auto: a long-lived engine" in llm.describe()["compile_decode"]
    assert _tokens(llm, params) == want  # (whatever was ready by then)
    assert compiled.wait_until_compiled(timeout=300)
    assert compiled.ready == compiled.compiled == {(1, 4), (4, 4)} and len(compiled.ready_after) == 2
    # (Programs an earlier test of the session kept on disk are loaded, and the description says how many.)
    assert re.fullmatch(r"on \(2 batch sizes, 2 of 2 programs ready(, [12] loaded from disk)?; auto: a long-lived "
                        r"engine\)", llm.describe()["compile_decode"])
    traced = counters["stats"]["calls_captured"]
    assert _tokens(llm, params) == want
    assert counters["stats"]["calls_captured"] == traced
    llm.close()


def test_auto_compiles_only_when_the_engine_is_idle_or_has_waited_long_enough(monkeypatch):
    # A program being traced holds the interpreter for seconds: the background thread starts one only while
    # the engine has no request running (or after COMPILE_WAIT_FOR_IDLE_S of waiting for that).
    from minipd.engine import compiled_decode

    need_cpu_kernel()
    llm = LLM("tiny-py", long_lived=True, compile_batch_sizes=(1,), max_model_len=64, max_num_seqs=1)
    compiled = llm.engine.core.runner.compiled
    compiled.stop_compiling()  # (this engine's own thread: the test drives a fresh one below)
    monkeypatch.setattr(compiled_decode, "COMPILE_WAIT_FOR_IDLE_S", 1.5)
    fresh = compiled_decode.CompiledDecode(compiled.model, compiled.pool, compiled.attend, [1], 4, width_buckets=False)
    fresh.idle.clear()  # as during a step
    began = time.monotonic()
    fresh.compile_in_background(torch.get_num_threads())
    time.sleep(0.5)
    assert fresh.compiled == set()  # still waiting for an idle moment
    assert fresh.wait_until_compiled(timeout=300) and fresh.ready == {(1, 4)}
    assert time.monotonic() - began >= 1.4  # ... and compiled once it had waited long enough


def test_auto_leaves_short_lived_engines_and_what_it_does_not_cover_eager():
    assert LLM("tiny-py").describe()["compile_decode"] == \
        "off (auto: a short-lived engine (long_lived=False); compile_decode=True compiles)"
    assert LLM("tiny-py", compile_decode=False, long_lived=True).describe()["compile_decode"] == "off"
    moe = LLM("tiny-py-moe", long_lived=True, record_routing=True)
    assert moe.engine.core.runner.compiled is None
    assert moe.describe()["compile_decode"] == "off (auto: the compiled step does not cover record_routing)"
    # A quantized pool (KIVI's too) is read by the torch attention, whose programs are per table width:
    # compile_decode=True compiles them.
    for kv_cache_dtype in ("int8", "int4"):
        quantized = LLM("tiny-py", long_lived=True, kv_cache_dtype=kv_cache_dtype)
        assert "the torch attention needs a program per table width" in quantized.describe()["compile_decode"]
    torch_attention = LLM("tiny-py", long_lived=True, kernel_backend="torch")
    assert "the torch attention needs a program per table width" in torch_attention.describe()["compile_decode"]


def test_a_long_lived_disaggregated_engine_compiles_in_its_decode_worker_only():
    from minipd.pd.llm import DisaggregatedLLM

    need_cpu_kernel()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = LLM("tiny-py", max_model_len=64).generate(PROMPTS[:2], params)
    with DisaggregatedLLM("tiny-py", long_lived=True, compile_batch_sizes=[1, 2], max_num_seqs=2, max_model_len=64,
                          kv_transport="torch", start_timeout=120) as llm:
        info = llm.describe()
        assert info["decode_engine"]["compile_decode"].endswith("auto: a long-lived engine)"), info
        assert info["prefill_engine"]["compile_decode"] == "off", info  # a prefill worker takes no decode step
        got = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
