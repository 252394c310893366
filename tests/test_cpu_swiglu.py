"""SwiGLU's one-pass C++ activation (``silu_mul``): against ``F.silu(gate) * up`` on every path (eight lanes,
the tail, rows spread over threads, saturated inputs), its portable (no AVX2) build, its refusals, and whole
models: the engine gives it to every SwiGLU when it runs the C++ kernels, and the tokens do not change."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import need_cpu_kernel

from minipd import LLM, SamplingParams
from minipd.layers.mlp import SwiGLU

PROMPTS = ["def fib(n):", "import os\nclass Foo:", "for i in range(10):\n    print(", "x = ["]


@pytest.fixture(scope="module")
def kernels():
    return need_cpu_kernel()


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 2000])
@pytest.mark.parametrize("width", [1, 8, 13, 704])
def test_silu_mul_is_silu_of_the_gate_times_up(kernels, rows, width):
    torch.manual_seed(rows * 1000 + width)
    gate_up = torch.randn(rows, 2 * width) * 6
    if rows:
        gate_up[0, 0], gate_up[-1, width - 1] = -200.0, 200.0  # saturated: exp clamps, silu stays 0 and x
    got = kernels.silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(gate_up), rtol=1e-5, atol=1e-6)


def test_silu_mul_refuses_what_it_does_not_read(kernels):
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        kernels.silu_mul(torch.randn(4, 8, dtype=torch.float64))
    for bad in (torch.randn(4, 7), torch.randn(8), torch.randn(8, 4).t()):
        with pytest.raises(RuntimeError, match=r"contiguous \(rows, 2 x width\)"):
            kernels.silu_mul(bad)


def test_the_portable_path_without_avx2_is_the_reference(tmp_path):
    # Where the CPU has no AVX2/FMA, the plain C++ loop runs: built here without them (in a child process, whose
    # op registrations cannot clash with this one's) from the same sources, and compared with torch.
    need_cpu_kernel()
    flags = ["-O2"] + (["-mno-avx2", "-mno-fma"] if platform.machine().lower() in ("x86_64", "amd64") else [])
    script = textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        from torch.utils.cpp_extension import load_inline
        from minipd.kernels.cpu_paged_attention import _SOURCE
        m = load_inline("minipd_swiglu_portable", cpp_sources=[_SOURCE], functions=["silu_mul"],
                        extra_cflags={flags!r}, build_directory={str(tmp_path)!r})
        torch.manual_seed(0)
        for rows, width in ((1, 13), (50, 704)):
            x = torch.randn(rows, 2 * width) * 6
            gate, up = x.chunk(2, dim=-1)
            torch.testing.assert_close(m.silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
        print("portable ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "portable ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("weights", ["float32", "int8"])  # int8 weights: the activations are fp32 all the same
def test_the_engine_fuses_every_swiglu_with_the_cpu_kernels_and_the_tokens_stay(kernels, weights):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    fused = LLM("tiny-py", kernel_backend="cpu", compile_decode=False,
                weight_dtype="auto" if weights == "float32" else weights)
    layers = [m for m in fused.model.modules() if isinstance(m, SwiGLU)]
    assert layers and all(layer.fused_silu_mul is kernels.silu_mul for layer in layers)
    got = fused.generate(PROMPTS, params)
    for layer in layers:
        layer.fused_silu_mul = None  # torch's ops, the same engine otherwise
    want = fused.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        chosen = [(step[t], ref[t]) for step, ref, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True)]
        assert max(abs(x - y) for x, y in chosen) < 1e-4


def test_an_engine_on_the_torch_kernels_keeps_torch_s_activation():
    plain = LLM("tiny-py", kernel_backend="torch", compile_decode=False)
    assert all(m.fused_silu_mul is None for m in plain.model.modules() if isinstance(m, SwiGLU))
