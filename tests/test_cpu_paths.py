"""CPU fast paths: oneDNN-packed linears (same answers as F.linear, same greedy outputs) and the
per-step thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import need_cpu_kernel
from torch import nn

from minipd import LLM, SamplingParams
from minipd.engine.threads import SMALL_STEP_TOKENS, threads_for_step
from minipd.kernels.cpu_linear import (
    TRACED_SUM_ROWS,
    TRACED_SUM_ROWS_UNCACHED,
    PackedLinear,
    onednn_available,
    pack_linears,
    rows_linear,
    traced_sum_rows,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
PROMPTS = ["def fib(n):", "import os\nclass Foo:", "for i in range(10):\n    print(", "x = [", "return self."]


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (64, 24), (2, 5, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = packed(x), F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # the one-row path (a transposed copy) and the packed path agree with each other
        torch.testing.assert_close(packed(x[..., :1, :]), packed(torch.cat([x[..., :1, :]] * 3, -2))[..., :1, :],
                                   rtol=1e-5, atol=1e-5)
    # A non-contiguous input (a split's view) gives the same answer.
    wide = torch.randn(7, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(wide[:, :24]), F.linear(wide[:, :24], linear.weight, linear.bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_linear_is_f_linear(rows, bias):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 96), torch.randn(40, 96)
    b = torch.randn(40) if bias else None
    torch.testing.assert_close(rows_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_compiled_packed_linear_sums_few_rows_itself_and_packs_many():
    # Compiled, a call of few rows is written as a multiply-and-sum (no matrix product left in the program);
    # more rows go to oneDNN's packed product. Both give F.linear's answer.
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PackedLinear(linear)
    for rows, matmul in ((1, False), (TRACED_SUM_ROWS, False), (TRACED_SUM_ROWS + 1, True)):
        torch._dynamo.reset()
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got, code = run_and_get_code(torch.compile(packed, fullgraph=True, dynamic=False), x)
            torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        source = "\n".join(code)
        assert ("onednn_linear" in source) is matmul, rows


@needs_onednn
@pytest.mark.parametrize("cache_mb, want", [(64, TRACED_SUM_ROWS), (1, TRACED_SUM_ROWS_UNCACHED),
                                            (None, TRACED_SUM_ROWS_UNCACHED)])
def test_compiled_linears_sum_many_rows_only_while_the_model_fits_in_the_cache(monkeypatch, cache_mb, want):
    # A multiply-and-sum reads the weight once per row: from the cache for tiny-py's 20 MB, from memory for a
    # model that does not fit (a 50M model's 8-row step took 45 ms against oneDNN's 18), where it is kept
    # for the rows at which it still wins. The choice is the whole model's, and a program shows it.
    from torch._inductor.utils import run_and_get_code

    import minipd.kernels.cpu_linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: None if cache_mb is None else cache_mb << 20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))  # 2 MB of weights
    assert pack_linears(model) == 2
    assert {m.traced_sum_rows for m in model.modules() if isinstance(m, PackedLinear)} == {want}
    assert traced_sum_rows(2 << 20, 2 << 20) == TRACED_SUM_ROWS and traced_sum_rows((2 << 20) + 1, 2 << 20) == 2
    rows = TRACED_SUM_ROWS_UNCACHED + 1
    torch._dynamo.reset()
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        got, code = run_and_get_code(torch.compile(model, fullgraph=True, dynamic=False), x)
        want_out = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
        torch.testing.assert_close(got, want_out, rtol=1e-4, atol=1e-4)
    assert ("onednn_linear" in "\n".join(code)) is (want == TRACED_SUM_ROWS_UNCACHED)


def test_the_last_level_cache_is_read_from_linux():
    from minipd.kernels.measured import last_level_cache_bytes

    size = last_level_cache_bytes()
    if not Path("/sys/devices/system/cpu/cpu0/cache").exists():
        assert size is None
    else:
        assert size is not None and size >= 256 << 10  # at least an L2's worth


@needs_onednn
def test_packing_keeps_parameters_and_ties():
    llm = LLM("tiny-py", linear_backend="onednn")
    model = llm.model
    assert llm.engine.core.linear_backend == "onednn"
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2 * 6 + 2 * 6 + 1  # qkv, o, gate_up, down, head
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    assert pack_linears(model) == 0  # nothing left to pack


@needs_onednn
@pytest.mark.parametrize("model", ["tiny-py", "tiny-py-moe"])
def test_onednn_linears_give_the_same_greedy_tokens(model):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 5, 40, 12, 30)]
    plain = LLM(model, linear_backend="torch")
    fast = LLM(model, linear_backend="onednn")
    assert fast.engine.core.linear_backend == "onednn" and plain.engine.core.linear_backend == "torch"
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == want


def test_linear_backend_errors_name_the_option():
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        LLM("tiny-py", linear_backend="mkl")
    with pytest.raises(ValueError, match="linear_backend='onednn' packs fp32 weights on the CPU"):
        LLM("tiny-py", dtype="bfloat16", linear_backend="onednn")
    # auto, bf16 weights: minipd's panel kernel where it is built (oneDNN's packing takes fp32 only), else torch
    from minipd.kernels.cpu_linear import panel_kernels

    want = "cpu" if panel_kernels() is not None else "torch"
    assert LLM("tiny-py", dtype="bfloat16").engine.core.linear_backend == want


def test_threads_per_step_rule():
    assert threads_for_step("auto", 1, 8) == 1
    assert threads_for_step("auto", SMALL_STEP_TOKENS, 8) == 1
    assert threads_for_step("auto", SMALL_STEP_TOKENS + 1, 8) == 8
    assert threads_for_step(3, 1, 8) == 3
    with pytest.raises(ValueError, match="cpu_threads must be 'auto' or a positive integer"):
        LLM("tiny-py", cpu_threads=0)


def test_step_threads_change_only_when_needed_and_give_the_count_back():
    from minipd.engine.threads import StepThreads

    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    threads = StepThreads()
    threads.enter(before)  # nothing to change
    threads.restore()
    assert torch.get_num_threads() == before
    try:
        threads.enter(other)
        threads.enter(other)
        assert torch.get_num_threads() == other
        threads.enter(before)
        threads.enter(other)
    finally:
        threads.restore()
    assert torch.get_num_threads() == before  # the count from before the first change


def test_engine_runs_small_steps_on_one_thread_and_big_ones_on_all():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM("tiny-py", max_num_batched_tokens=64)
        seen: list[tuple[int, int]] = []

        def record(module, args) -> None:
            seen.append((args[0].numel(), torch.get_num_threads()))

        llm.model.register_forward_pre_hook(record)
        llm.generate(["def " * 30], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert seen[0][0] > SMALL_STEP_TOKENS and seen[0][1] == 2  # the prefill: every thread
        assert all(threads == 1 for tokens, threads in seen if tokens <= SMALL_STEP_TOKENS)  # decodes: one
        assert torch.get_num_threads() == 2  # the caller's count is back once the run is over
        fixed = LLM("tiny-py", cpu_threads=2)
        seen.clear()
        fixed.model.register_forward_pre_hook(record)
        fixed.generate(["def"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert seen and all(threads == 2 for _, threads in seen)
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------ the C++ paged decode kernel

# Groups of 4, 1, 8, 3 and 6 query heads (the vectorised path takes up to 4 at a time); head sizes that are
# multiples of 16 (16, 32, 64) and of 8 only (24, 40: their last 8 entries take a narrower loop).
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (4, 4, 16), (8, 1, 64), (6, 2, 24), (12, 2, 40)])
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("block_size", [8, 32])  # 64-key chunks span blocks; a 32-key block spans 16-key ones
def test_cpu_decode_kernel_matches_the_reference(heads, kv_heads, dim, window, block_size):
    from minipd.kernels.cpu_paged_attention import paged_decode_attention_cpu
    from minipd.kernels.paged_attention import paged_decode_attention_torch

    need_cpu_kernel()
    torch.manual_seed(heads * dim + (window or 0))
    blocks = 60
    k, v = torch.randn(blocks, block_size, kv_heads, dim), torch.randn(blocks, block_size, kv_heads, dim)
    # Lengths on and off block and chunk boundaries (16 and 64 keys), a single token, and long ones spanning
    # several chunks; tables shuffled.
    lens = torch.tensor([1, 8, 9, 16, 17, 100, 33, 64, 2, 31, 65, 200])
    tables = torch.stack([torch.randperm(blocks)[:25] for _ in lens])
    q = torch.randn(len(lens), heads, dim)
    want = paged_decode_attention_torch(q, k, v, tables, lens, 0.2, window)
    got = paged_decode_attention_cpu(q, k, v, tables, lens, 0.2, window, context_lens_host=lens.tolist())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpu_decode_kernel_leaves_other_formats_to_the_reference():
    from minipd.kernels.cpu_paged_attention import paged_decode_attention_cpu
    from minipd.kernels.paged_attention import paged_decode_attention_torch

    k, v = torch.randn(4, 8, 2, 16).double(), torch.randn(4, 8, 2, 16).double()
    q, lens, tables = torch.randn(2, 4, 16).double(), torch.tensor([5, 20]), torch.tensor([[0, 1, 2], [3, 2, 1]])
    assert torch.equal(paged_decode_attention_cpu(q, k, v, tables, lens, 0.25),
                       paged_decode_attention_torch(q, k, v, tables, lens, 0.25))
    # fp16 (and bf16) pools it reads itself, where built (tests/test_cpu_kernels.py covers every path).
    half = paged_decode_attention_cpu(q.float(), k.half(), v.half(), tables, lens, 0.25)
    torch.testing.assert_close(half, paged_decode_attention_torch(q.float(), k.half(), v.half(), tables, lens, 0.25),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["tiny-py", "tiny-py-moe"])
def test_cpu_backend_gives_the_reference_greedy_tokens(model):
    need_cpu_kernel()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 5, 40, 12, 30)]
    want = [o.token_ids for o in LLM(model, kernel_backend="torch").generate(PROMPTS, params)]
    fast = LLM(model, kernel_backend="cpu", block_size=8)
    assert fast.engine.core.kernels.name == "cpu"
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == want
    assert LLM(model).engine.core.kernels.name == "cpu"  # built, so the CPU default


def test_cpu_backend_refuses_other_devices():
    from minipd.kernels.backend import get_backend

    with pytest.raises(ValueError, match="kernel_backend='cpu' runs on the CPU"):
        get_backend("cpu", torch.device("meta"))


# ------------------------------------------------------------------------------------- int8 weights

def test_int8_rows_round_trip_within_half_a_step():
    from minipd.kernels.int8_linear import quantize_rows

    w = torch.randn(40, 24) * torch.linspace(0.01, 3, 40)[:, None]  # rows of very different ranges
    codes, scales = quantize_rows(w)
    assert codes.dtype == torch.int8 and scales.shape == (40,)
    assert ((codes.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6).all()
    assert codes.abs().amax(dim=1).eq(127).all()  # every row uses its full range


def test_int8_linear_is_the_dequantized_product_in_bf16():
    from minipd.kernels.int8_linear import Int8Linear

    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=True)
    int8 = Int8Linear(linear)
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        got = int8(x)
        want = F.linear(x.bfloat16().float(), int8.weight, linear.bias)
    assert got.shape == (3, 5, 48) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 activations
    assert (got - F.linear(x, linear.weight, linear.bias)).abs().max() < 0.1


def test_int8_weights_in_the_engine_and_in_the_quality_table():
    from minipd.evaluation.kv_quality import method_options
    from minipd.kernels.int8_linear import Int8Linear

    llm = LLM("tiny-py", weight_dtype="int8")
    assert sum(isinstance(m, Int8Linear) for m in llm.model.modules()) == 25
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = llm.generate(PROMPTS, params)
    want = LLM("tiny-py").generate(PROMPTS, params)
    assert all(len(o.token_ids) == 24 for o in got)
    # Not the same numbers, but the same model: most first tokens agree.
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(got, want, strict=True)) >= 3
    assert method_options("weights-int8") == {"weight_dtype": "int8"}
    with pytest.raises(ValueError, match="weight_dtype must be 'auto' or 'int8'"):
        LLM("tiny-py", weight_dtype="int4")


def test_a_bf16_model_is_measured_like_a_kv_format():
    # dtype="bfloat16" (opt-in, for CPUs with bf16 arithmetic) changes every number of the model: its cost is
    # measured like the KV formats', against the fp32 reference, and must be small but not zero.
    from minipd.evaluation.kv_quality import measure, method_options

    assert method_options("model-bf16") == {"dtype": "bfloat16"}
    reference, bf16 = measure("tiny-py", ["model-bf16"], window=64, num_windows=2, greedy_prompts=2,
                              greedy_tokens=24, num_probes=1, progress=False)
    assert reference.method == "auto" and reference.mean_kl == pytest.approx(0, abs=1e-6)
    assert bf16.method == "model-bf16" and bf16.bytes_per_token == reference.bytes_per_token / 2
    assert 0 < bf16.mean_kl < 0.05 and abs(bf16.perplexity_change) < 0.05 and bf16.greedy_equal > 0.3


def test_two_engines_on_one_model_keep_their_own_linears():
    """Packing (oneDNN) and int8 quantization apply to the engine's view of the model, never to a model
    another engine (or the caller) holds: each engine runs the linears it asked for."""
    from minipd.engine.config import EngineConfig
    from minipd.engine.core import EngineCore
    from minipd.kernels.int8_linear import Int8Linear
    from minipd.models.loading import load_model

    def kinds(m: nn.Module) -> set[str]:
        return {type(x).__name__ for x in m.modules() if isinstance(x, (nn.Linear, PackedLinear, Int8Linear))}

    model, _ = load_model("tiny-py")
    before = kinds(model)
    cores = {name: EngineCore(model, EngineConfig(num_kv_blocks=32, **options), 256) for name, options in
             {"torch": {"linear_backend": "torch"}, "int8": {"weight_dtype": "int8"},
              **({"onednn": {"linear_backend": "onednn"}} if onednn_available() else {})}.items()}
    assert kinds(model) == before  # the caller's model is untouched
    assert cores["torch"].linear_backend == "torch" and "PackedLinear" not in kinds(cores["torch"].model)
    assert "Int8Linear" in kinds(cores["int8"].model)
    if "onednn" in cores:
        assert cores["onednn"].linear_backend == "onednn" and "PackedLinear" in kinds(cores["onednn"].model)
        assert "PackedLinear" not in kinds(cores["torch"].model)  # built before, still its own
    else:
        print("oneDNN is not available here: the packed engine of this check was not built")


def test_auto_linears_follow_what_was_measured_on_this_machine(tmp_path, monkeypatch):
    from minipd.engine.measure import measure_linear_backend
    from minipd.kernels.measured import machine_key, measured_choice, save_choice

    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    record = measure_linear_backend(rounds=1, cases=((1, 8), (4, 16)))
    candidates = record["candidates"]
    assert candidates[0] == "torch" and record["choice"] in candidates
    assert ("onednn" in candidates) == onednn_available()
    if len(candidates) > 1:  # every path timed on every case; the fastest packed path wins by the margin
        assert set(record["cases"]) == {"1x8", "4x16"} and set(record["ratios"]) == set(candidates)
        fastest = min(candidates[1:], key=record["ratios"].__getitem__)
        assert record["choice"] == (fastest if record["ratios"][fastest] < 0.95 else "torch")
    assert measured_choice("linear_backend") is None
    assert "not measured" in LLM("tiny-py", num_kv_blocks=16).describe()["linear_backend_reason"] or \
        len(candidates) == 1
    for choice in candidates:
        save_choice("linear_backend", {**record, "choice": choice})
        assert measured_choice("linear_backend") == choice
        info = LLM("tiny-py", num_kv_blocks=16).describe()
        assert info["linear_backend"] == choice and info["linear_backend_reason"].startswith("measured")
    # A measurement of another machine (or another thread count) is not this one's.
    assert machine_key(threads=99) != machine_key() and measured_choice("linear_backend", threads=99) is None
    assert LLM("tiny-py", num_kv_blocks=16, linear_backend="torch").describe()["linear_backend_reason"] == "asked for"


def test_the_one_thread_step_size_follows_what_was_measured(tmp_path, monkeypatch):
    from minipd.engine.measure import measure_small_step_tokens
    from minipd.kernels.measured import save_choice

    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    record = measure_small_step_tokens(threads=2, rounds=1, sizes=(1, 4))
    assert record["choice"] in (0, 1, 4) and set(record["one_thread_vs_all"]) == {1, 4}
    assert LLM("tiny-py", num_kv_blocks=16).engine.core.small_step_tokens == SMALL_STEP_TOKENS  # not measured
    save_choice("small_step_tokens", {**record, "choice": 16})
    llm = LLM("tiny-py", num_kv_blocks=16)
    assert llm.engine.core.small_step_tokens == 16 and llm.describe()["one_thread_up_to_tokens"] == 16
    assert threads_for_step("auto", 16, 8, small=16) == 1 and threads_for_step("auto", 17, 8, small=16) == 8
