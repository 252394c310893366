"""The one-pass C++ elementwise kernels of the ``"cpu"`` backend, each against its torch reference: SwiGLU's
activation (``silu_mul``: eight lanes, the tail, rows spread over threads, saturated inputs), RMSNorm, the residual
add + RMSNorm and RoPE (odd widths, strided views as the fused qkv projection gives them, rows over threads);
their refusals, the Python wrappers' fallbacks (other dtypes, gradients, while compiling); and whole models: the
engine runs them when it runs the C++ kernels, and the tokens do not change. Their AVX2 and portable (no AVX2)
builds: this file run again against each (``tests/test_cpu_isa.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import need_cpu_kernel

from minipd import LLM, SamplingParams
from minipd.config import RopeConfig
from minipd.kernels import cpu_norm_rope
from minipd.kernels.activation import silu_and_mul
from minipd.kernels.cpu_norm_rope import add_rms_norm_cpu, apply_rotary_cpu, rms_norm_cpu, silu_mul_cpu
from minipd.kernels.rms_norm import add_rms_norm, rms_norm
from minipd.kernels.rotary import apply_rotary
from minipd.layers.rotary import RotaryEmbedding

PROMPTS = ["def fib(n):", "import os\nclass Foo:", "for i in range(10):\n    print(", "x = ["]


@pytest.fixture(scope="module")
def kernels():
    return need_cpu_kernel()


@pytest.fixture
def kernel_calls(kernels, monkeypatch):
    """The names of the C++ functions the wrappers of :mod:`minipd.kernels.cpu_norm_rope` called, in order."""
    calls: list[str] = []

    def spied(name):
        fn = getattr(kernels, name, None)
        return None if fn is None else (lambda *args: calls.append(name) or fn(*args))

    monkeypatch.setattr(cpu_norm_rope, "_kernel", spied)
    return calls


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 2000])
@pytest.mark.parametrize("width", [1, 8, 13, 704])
def test_silu_mul_is_silu_of_the_gate_times_up(kernels, rows, width):
    torch.manual_seed(rows * 1000 + width)
    gate_up = torch.randn(rows, 2 * width) * 6
    if rows:
        gate_up[0, 0], gate_up[-1, width - 1] = -200.0, 200.0  # saturated: exp clamps, silu stays 0 and x
    got = kernels.silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, silu_and_mul(gate_up), rtol=1e-5, atol=1e-6)


def test_silu_mul_refuses_what_it_does_not_read(kernels):
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        kernels.silu_mul(torch.randn(4, 8, dtype=torch.float64))
    for bad in (torch.randn(4, 7), torch.randn(8), torch.randn(8, 4).t()):
        with pytest.raises(RuntimeError, match=r"contiguous \(rows, 2 x width\)"):
            kernels.silu_mul(bad)


@pytest.mark.parametrize("rows", [0, 1, 5, 3000])
@pytest.mark.parametrize("dim", [1, 7, 32, 256])
def test_rms_norm_and_the_fused_add_are_the_references(kernels, rows, dim):
    torch.manual_seed(rows * 100 + dim)
    x, residual, weight = torch.randn(rows, dim) * 3, torch.randn(rows, dim), torch.randn(dim)
    torch.testing.assert_close(kernels.rms_norm_f32(x, weight, 1e-5), rms_norm(x, weight, 1e-5),
                               rtol=1e-5, atol=1e-5)
    normed, summed = kernels.add_rms_norm_f32(x, residual, weight, 1e-6)
    want_normed, want_summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed)  # one addition each: the same bits
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
    # A row of zeros is eps's to keep finite; a 3-d input is normed on its last dimension.
    zeros = torch.zeros(2, 3, dim)
    assert torch.equal(kernels.rms_norm_f32(zeros, weight, 1e-5), torch.zeros(2, 3, dim))


@pytest.mark.parametrize("tokens", [1, 3, 700])
@pytest.mark.parametrize("heads, dim", [(1, 2), (10, 32), (3, 64)])
def test_rotary_is_the_reference_on_strided_views(kernels, tokens, heads, dim):
    torch.manual_seed(tokens + heads * dim)
    rope = RotaryEmbedding(dim, 1024, RopeConfig(theta=10000.0))
    cos, sin = rope.cos_sin(torch.randint(0, 1024, (tokens,)), torch.float32)
    # q and k as the attention takes them: a view into wider rows (the fused projection's), heads side by side.
    rows = torch.randn(tokens, heads * dim + 40)
    x = rows[:, :heads * dim].view(tokens, heads, dim)
    assert tokens == 1 or not x.is_contiguous()
    got = kernels.rotary_f32(x, cos, sin)
    assert got.is_contiguous() and got.shape == (tokens, heads, dim)
    torch.testing.assert_close(got, apply_rotary(x, cos, sin), rtol=1e-6, atol=1e-6)
    # A head stride that is not head_dim (every other head of the rows) reads right too.
    every_other = rows[:, :heads * dim].view(tokens, heads, dim)[:, ::2]
    torch.testing.assert_close(kernels.rotary_f32(every_other, cos, sin), apply_rotary(every_other, cos, sin),
                               rtol=1e-6, atol=1e-6)


def test_norm_and_rope_kernels_refuse_what_they_do_not_read(kernels):
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        kernels.rms_norm_f32(torch.randn(4, 8, dtype=torch.float64), weight, 1e-5)
    with pytest.raises(RuntimeError, match="last dimension of 8"):
        kernels.rms_norm_f32(torch.randn(4, 7), weight, 1e-5)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        kernels.rms_norm_f32(torch.randn(8, 4).t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="of one shape"):
        kernels.add_rms_norm_f32(torch.randn(4, 8), torch.randn(3, 8), weight, 1e-5)
    cos = sin = torch.ones(4, 1, 8)
    with pytest.raises(RuntimeError, match="even, contiguous head_dim"):
        kernels.rotary_f32(torch.randn(4, 2, 7), cos, sin)
    with pytest.raises(RuntimeError, match="even, contiguous head_dim"):
        kernels.rotary_f32(torch.randn(4, 8, 2).transpose(1, 2), cos, sin)
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous \(tokens"):
        kernels.rotary_f32(torch.randn(4, 2, 8), torch.ones(3, 1, 8), torch.ones(3, 1, 8))


def test_the_wrappers_fall_back_to_torch_where_the_kernels_do_not_apply(kernel_calls):
    torch.manual_seed(0)
    weight = torch.randn(16)
    x64 = torch.randn(5, 16, dtype=torch.float64)
    assert rms_norm_cpu(x64, weight.double(), 1e-5).dtype == torch.float64  # not fp32: the reference
    bf16 = torch.randn(5, 2, 16, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(16, 64, RopeConfig()).cos_sin(torch.arange(5), torch.bfloat16)
    assert torch.equal(apply_rotary_cpu(bf16, cos, sin), apply_rotary(bf16, cos, sin))
    # Tensors that need gradients keep autograd's graph (the kernels would cut it).
    x = torch.randn(5, 16, requires_grad=True)
    rms_norm_cpu(x, weight, 1e-5).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    residual = torch.randn(5, 16)
    normed, _ = add_rms_norm_cpu(x, residual, weight, 1e-5)
    assert normed.requires_grad
    gate_up = torch.randn(3, 8, requires_grad=True)
    silu_mul_cpu(gate_up).sum().backward()
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0
    assert kernel_calls == []  # none of the above reached a kernel
    # Under inference mode the kernels run, and agree.
    with torch.inference_mode():
        torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
        torch.testing.assert_close(silu_mul_cpu(gate_up[None]), silu_and_mul(gate_up[None]))
    assert kernel_calls == ["rms_norm_f32", "silu_mul"]
    # While compiling, torch's ops are traced (the compiler fuses them); the compiled function agrees.
    compiled = torch.compile(lambda a, b: add_rms_norm_cpu(a, b, weight, 1e-5)[0], backend="eager", fullgraph=True)
    a, b = torch.randn(6, 16), torch.randn(6, 16)
    torch.testing.assert_close(compiled(a, b), add_rms_norm(a, b, weight, 1e-5)[0])
    assert kernel_calls == ["rms_norm_f32", "silu_mul"]  # the compiled one did not call a kernel


@pytest.mark.parametrize("weights", ["float32", "int8"])  # int8 weights: the activations are fp32 all the same
def test_the_engine_runs_the_fused_kernels_with_the_cpu_backend_and_the_tokens_stay(kernel_calls, weights):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    fused = LLM("tiny-py", kernel_backend="cpu", compile_decode=False,
                weight_dtype="auto" if weights == "float32" else weights)
    runner = fused.engine.core.runner
    with_kernels = runner.kernels
    assert (with_kernels.rms_norm, with_kernels.add_rms_norm, with_kernels.rotary, with_kernels.silu_mul) == \
        (rms_norm_cpu, add_rms_norm_cpu, apply_rotary_cpu, silu_mul_cpu)
    del kernel_calls[:]
    got = fused.generate(PROMPTS, params)
    # Every layer of every step ran each kernel: one input norm, one add + norm, one rotation and one activation,
    # and the final norm once a step.
    layers, steps = fused.config.num_hidden_layers, fused.engine.core.num_steps
    counts = {name: kernel_calls.count(name) for name in set(kernel_calls)}
    assert counts == {"rms_norm_f32": (layers + 1) * steps, "add_rms_norm_f32": layers * steps,
                      "rotary_f32": layers * steps, "silu_mul": layers * steps}, (counts, steps)
    runner.kernels = dataclasses.replace(with_kernels, rms_norm=rms_norm, add_rms_norm=add_rms_norm,
                                         rotary=apply_rotary, silu_mul=silu_and_mul)  # torch's ops, same engine
    del kernel_calls[:]
    want = fused.generate(PROMPTS, params)
    assert kernel_calls == []
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # int8 weights multiply bf16 activations: an input one fp32 rounding apart can land on the other side of a
    # bf16 step (0.4%), and six layers carry it on; the tokens must still be the same. Where such flips land moves
    # with any change of rounding elsewhere: these prompts had 5 such differences of 0.024-0.030 with the AVX2
    # decode attention and 4 of 0.023-0.050 with the AVX-512 one (both equal to the reference within 1e-5).
    tolerance = 1e-4 if weights == "float32" else 0.1
    for a, b in zip(got, want, strict=True):
        chosen = [(step[t], ref[t]) for step, ref, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True)]
        assert max(abs(x - y) for x, y in chosen) < tolerance


def test_an_engine_on_the_torch_kernels_keeps_torch_s_ops():
    plain = LLM("tiny-py", kernel_backend="torch", compile_decode=False)
    kernels = plain.engine.core.runner.kernels
    assert (kernels.rms_norm, kernels.add_rms_norm, kernels.rotary, kernels.silu_mul) == \
        (rms_norm, add_rms_norm, apply_rotary, silu_and_mul)
