"""minipd's C++ panel linears (``linear_backend="cpu"``): the kernel against ``F.linear`` on every path it takes
(register blocks of 1-6 rows, 1-12 in an AVX-512 build; row chunks, short last panels, bias, strided input; fp32,
bf16 and fp16 weights), compiled and eager, the greedy tokens of whole models, and how ``linear_backend="auto"``
picks it. Its AVX2 and portable (no AVX2) paths: this file run again against those builds
(``tests/test_cpu_isa.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import need_cpu_kernel
from torch import nn

from minipd import LLM, SamplingParams
from minipd.kernels.cpu_linear import PanelLinear, pack_panel_linears, unpack_linears

PROMPTS = ["def fib(n):", "import os\nclass Foo:", "for i in range(10):\n    print(", "x = [", "return self."]


@pytest.fixture(scope="module")
def kernels():
    return need_cpu_kernel()


# Rows: each register block size (1-6 with AVX2; 1-16 with AVX-512, where up to 16 rows are one block, 17 two of 8
# and 9, 25 three), several blocks, and more rows than one chunk holds (K=2000: 30 rows a chunk with AVX2, 24 with
# AVX-512), so every loop of the kernel runs; features: whole panels, a short last one, fewer than one.
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 14, 15, 16, 17, 25, 64, 97])
@pytest.mark.parametrize("in_features, out_features", [(64, 48), (2000, 40), (33, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_panel_kernel_is_f_linear(kernels, rows, in_features, out_features, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias)
    panels = kernels.pack_panels(linear.weight.detach())
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        got = kernels.panel_linear(x, panels, linear.bias, out_features)
        want = F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


# bf16 and fp16 weights: up to three register blocks widen them as they load (1-18 rows with AVX2, 1-36 with
# AVX-512), more rows share one widened copy of each panel (AVX2: 19 rows, four blocks; AVX-512: 37 rows; 97 rows
# with K=2000: several chunks).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 12, 13, 15, 16, 18, 19, 37, 97])
@pytest.mark.parametrize("in_features, out_features", [(64, 48), (2000, 40), (33, 5)])
def test_the_panel_kernel_takes_half_precision_weights(kernels, dtype, rows, in_features, out_features):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features).to(dtype)
    panels = kernels.pack_panels(linear.weight.detach())
    assert panels.dtype == dtype and panels.shape == (-(-out_features // 16), in_features, 16)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        # fp32 inputs: the fp32 product of the stored weights, to fp32's precision.
        exact = F.linear(x, linear.weight.float(), linear.bias.float())
        got = kernels.panel_linear(x, panels, linear.bias, out_features)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
        # Inputs in the weights' dtype: the same product of them, rounded once to that dtype (within one unit of
        # its last place: the two fp32 sums may round to neighbours).
        narrow = x.to(dtype)
        want = F.linear(narrow.float(), linear.weight.float(), linear.bias.float())
        got = kernels.panel_linear(narrow, panels, linear.bias, out_features)
        assert got.dtype == dtype
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(got.float(), want, rtol=ulp, atol=1e-3)
        # A bf16 layer of a model: the same through PanelLinear (no rows handed to torch unless measured).
        layer = PanelLinear(linear, kernels)
        torch.testing.assert_close(layer(narrow).float(), want, rtol=ulp, atol=1e-3)


def test_a_panel_linear_takes_any_leading_shape_and_strided_input(kernels):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    panel = PanelLinear(linear, kernels)
    assert panel.weight is linear.weight and panel.bias is linear.bias  # the parameters are the same tensors
    wide = torch.randn(2, 5, 48)
    with torch.inference_mode():
        for x in (wide[..., :24], wide[0, :, 24:], torch.randn(24)):  # views of a split, and a single vector
            torch.testing.assert_close(panel(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    # With gradients (a reader fine-tuning), the plain product runs: the kernel has no backward.
    x = torch.randn(3, 24)
    panel(x).sum().backward()
    assert linear.weight.grad is not None
    # A weight changed in place is seen once repacked.
    with torch.no_grad():
        linear.weight.mul_(2)
    panel.repack()
    with torch.inference_mode():
        torch.testing.assert_close(panel(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_what_it_cannot_multiply(kernels):
    panels = kernels.pack_panels(torch.randn(40, 24))
    with pytest.raises(RuntimeError, match="panels must be pack_panels"):
        kernels.panel_linear(torch.randn(3, 25), panels, None, 40)  # another number of inputs
    with pytest.raises(RuntimeError, match="panels must be pack_panels"):
        kernels.panel_linear(torch.randn(3, 24), panels, None, 60)  # more features than packed
    with pytest.raises(RuntimeError, match="x must be a 2-D CPU tensor of fp32, or of the panels' dtype"):
        kernels.panel_linear(torch.randn(3, 24).double(), panels, None, 40)
    with pytest.raises(RuntimeError, match="x must be a 2-D CPU tensor of fp32, or of the panels' dtype"):
        kernels.panel_linear(torch.randn(3, 24).bfloat16(), panels, None, 40)  # fp32 weights take fp32 inputs
    with pytest.raises(RuntimeError, match="x must be a 2-D CPU tensor of fp32, or of the panels' dtype"):
        kernels.panel_linear(torch.randn(3, 24).half(), kernels.pack_panels(torch.randn(40, 24).bfloat16()), None, 40)
    with pytest.raises(RuntimeError, match="bias of N values"):
        kernels.panel_linear(torch.randn(3, 24), panels, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="weight must be a 2-D fp32, bf16 or fp16 CPU tensor"):
        kernels.pack_panels(torch.randn(40, 24).double())
    with pytest.raises(ValueError, match="PanelLinear packs float32, bfloat16, float16 weights on the CPU"):
        PanelLinear(nn.Linear(4, 4).double(), kernels)


@pytest.mark.parametrize("rows", [1, 6, 16])
def test_a_compiled_panel_linear_calls_the_kernel_whole(kernels, rows):
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    model = nn.Sequential(PanelLinear(linear, kernels), nn.ReLU(), PanelLinear(nn.Linear(48, 20, bias=False), kernels))
    torch._dynamo.reset()
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        got, code = run_and_get_code(torch.compile(model, fullgraph=True, dynamic=False), x)
        want = F.linear(F.relu(F.linear(x, linear.weight, linear.bias)), model[2].weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "minipd_cpu.panel_linear" in "\n".join(code)  # the op, not a matrix product the compiler wrote


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_an_fp32_panel_linear_hands_batches_from_its_measured_rows_to_onednn(kernels, rows):
    from torch._inductor.utils import run_and_get_code

    from minipd.kernels.cpu_linear import onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear: the fp32 hand-over is never made (checked elsewhere)")
    torch.manual_seed(0)
    linear, last = nn.Linear(64, 48), nn.Linear(48, 20, bias=False)
    model = nn.Sequential(PanelLinear(linear, kernels, matmul_rows=4), nn.ReLU(), PanelLinear(last, kernels, 4))
    assert all(m.packed is not None and m.matmul_rows == 4 for m in (model[0], model[2]))
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = F.linear(F.relu(F.linear(x, linear.weight, linear.bias)), last.weight)
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(model, fullgraph=True, dynamic=False), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Below the measured rows the panel kernel multiplies; from them on, oneDNN's packed product (as ops, whole).
    assert ("minipd.onednn_linear" in "\n".join(code)) == (rows >= 4)
    assert ("minipd_cpu.panel_linear" in "\n".join(code)) == (rows < 4)


def test_fp32_engines_hand_batches_to_onednn_where_measured_and_give_the_same_tokens(kernels, tmp_path, monkeypatch):
    from minipd.kernels.cpu_linear import onednn_available
    from minipd.kernels.measured import save_choice

    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    unmeasured = LLM("tiny-py", linear_backend="cpu", compile_decode=False, num_kv_blocks=64)
    assert all(m.matmul_rows is None and m.packed is None for m in unmeasured.model.modules()
               if isinstance(m, PanelLinear))
    save_choice("narrow_matmul_rows", {"choice": {"float32": 4, "bfloat16": None, "float16": None}})
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    plain = LLM("tiny-py", linear_backend="torch", compile_decode=False)
    eager = LLM("tiny-py", linear_backend="cpu", compile_decode=False)
    layers = [m for m in eager.model.modules() if isinstance(m, PanelLinear)]
    if not onednn_available():
        assert all(m.matmul_rows is None and m.packed is None for m in layers)
        print("this torch build has no oneDNN linear: the hand-over was not made (checked: none packed for it)")
        return
    assert layers and all(m.matmul_rows == 4 and m.packed is not None for m in layers)
    compiled = LLM("tiny-py", linear_backend="cpu", compile_decode=True, compile_batch_sizes=(1, 2, 4, 8))
    want = plain.generate(PROMPTS, params)
    for got in (eager.generate(PROMPTS, params), compiled.generate(PROMPTS, params)):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want, strict=True):
            for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
                assert step_a.keys() == step_b.keys()
                assert max(abs(step_a[t] - step_b[t]) for t in step_a) < 1e-3


@pytest.mark.parametrize("model", ["tiny-py", "tiny-py-moe"])
def test_panel_linears_give_the_same_greedy_tokens(kernels, model):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 5, 40, 12, 30)]
    plain = LLM(model, linear_backend="torch")
    fast = LLM(model, linear_backend="cpu")
    assert fast.engine.core.linear_backend == "cpu" and plain.engine.core.linear_backend == "torch"
    assert any(isinstance(m, PanelLinear) for m in fast.model.modules())
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == want


def test_compiled_decode_with_panel_linears_is_eager(kernels):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    eager = LLM("tiny-py", linear_backend="cpu", compile_decode=False)
    compiled = LLM("tiny-py", linear_backend="cpu", compile_decode=True, compile_batch_sizes=(1, 2, 4, 8))
    want, got = eager.generate(PROMPTS, params), compiled.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) < 1e-3


def test_packing_in_panels_keeps_parameters_and_ties_and_unpacks(kernels):
    llm = LLM("tiny-py", linear_backend="cpu")
    model = llm.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, PanelLinear) for m in model.modules()) == 2 * 6 + 2 * 6 + 1  # qkv, o, gate_up, down, head
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    assert pack_panel_linears(model) == 0  # nothing left to pack
    weights = [m.weight for m in model.modules() if isinstance(m, PanelLinear)]
    assert unpack_linears(model) == len(weights)
    assert [m.weight for m in model.modules() if type(m) is nn.Linear] == weights  # the same tensors back


def test_auto_takes_the_panel_kernel_unless_measured_otherwise(kernels, tmp_path, monkeypatch):
    from minipd.kernels.cpu_linear import onednn_available
    from minipd.kernels.measured import save_choice

    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    info = LLM("tiny-py", num_kv_blocks=16).describe()  # nothing measured: the built kernel
    assert info["linear_backend"] == "cpu" and "not measured" in info["linear_backend_reason"]
    # A record from before the kernel existed did not time it: it does not count against it.
    save_choice("linear_backend", {"choice": "torch", "ratio": 1.0})
    info = LLM("tiny-py", num_kv_blocks=16).describe()
    assert info["linear_backend"] == "cpu" and "not measured" in info["linear_backend_reason"]
    # A record that timed it is followed, whichever path won.
    for choice in ("torch", "cpu", *(("onednn",) if onednn_available() else ())):
        save_choice("linear_backend", {"choice": choice, "candidates": ["torch", "onednn", "cpu"]})
        info = LLM("tiny-py", num_kv_blocks=16).describe()
        assert info["linear_backend"] == choice and info["linear_backend_reason"].startswith("measured")
    # bf16 weights: nothing measured between paths that do not all take them; the panel kernel where built.
    info = LLM("tiny-py", dtype="bfloat16", num_kv_blocks=16).describe()
    assert info["linear_backend"] == "cpu" and info["linear_backend_reason"].startswith("bfloat16 weights")
    with pytest.raises(ValueError, match="linear_backend='onednn' packs fp32 weights on the CPU"):
        LLM("tiny-py", dtype="bfloat16", linear_backend="onednn")


def test_a_bf16_model_streams_half_precision_panels_and_hands_large_batches_to_torch_where_measured(
        kernels, tmp_path, monkeypatch):
    from minipd.kernels.measured import save_choice

    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (24, 5, 40, 12, 30)]
    plain = LLM("tiny-py", dtype="bfloat16", linear_backend="torch", compile_decode=False)
    fast = LLM("tiny-py", dtype="bfloat16", compile_decode=False)
    layers = [m for m in fast.model.modules() if isinstance(m, PanelLinear)]
    assert layers and all(m.panels.dtype == torch.bfloat16 and m.matmul_rows is None for m in layers)
    want, got = plain.generate(PROMPTS, params), fast.generate(PROMPTS, params)
    # The same bf16 weights and activations, each product summed in fp32 in another order and rounded to bf16:
    # the first tokens agree, and where two tokens are almost tied a greedy path may go its own way after.
    assert [o.token_ids[0] for o in got] == [o.token_ids[0] for o in want]
    agree = [next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids, strict=True)) if a != b),
                  len(x.token_ids)) for x, y in zip(got, want, strict=True)]
    assert sum(agree) >= 0.7 * sum(len(o.token_ids) for o in want), agree
    # Where build-kernels measured torch's bf16 product faster from some row count, prefill goes that way.
    save_choice("narrow_matmul_rows", {"choice": {"bfloat16": 16, "float16": None}})
    measured = LLM("tiny-py", dtype="bfloat16", compile_decode=False)
    assert {m.matmul_rows for m in measured.model.modules() if isinstance(m, PanelLinear)} == {16}
    assert [o.token_ids[0] for o in measured.generate(PROMPTS, params)] == [o.token_ids[0] for o in want]


def test_without_the_built_kernel_cpu_is_refused_and_auto_falls_back(monkeypatch, tmp_path):
    import minipd.kernels.cpu_linear as cpu_linear
    from minipd.kernels.measured import save_choice

    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "panel_kernels", lambda: None)
    with pytest.raises(ValueError, match="needs minipd's C\\+\\+ CPU kernels: run `python -m minipd build-kernels`"):
        LLM("tiny-py", linear_backend="cpu")
    save_choice("linear_backend", {"choice": "cpu", "candidates": ["torch", "cpu"]})
    info = LLM("tiny-py", num_kv_blocks=16).describe()
    assert info["linear_backend"] in ("onednn", "torch") and "measured: 'cpu', not available now" in \
        info["linear_backend_reason"]
