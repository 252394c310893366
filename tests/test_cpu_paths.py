"""CPU fast paths: oneDNN-packed linears (same answers as F.linear, same greedy outputs) and the
per-step thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minipd import LLM, SamplingParams
from minipd.engine.threads import SMALL_STEP_TOKENS, threads_for_step, torch_threads
from minipd.kernels.cpu_linear import PackedLinear, onednn_available, pack_linears

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
    if x.numel() // x.shape[-1] == 1:
        assert torch.equal(got, want)  # one row stays on F.linear itself
    # A non-contiguous input (a split's view) gives the same answer.
    wide = torch.randn(7, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(wide[:, :24]), F.linear(wide[:, :24], linear.weight, linear.bias),
                                   rtol=1e-5, atol=1e-5)


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
    assert LLM("tiny-py", dtype="bfloat16").engine.core.linear_backend == "torch"  # auto: not for bf16


def test_threads_per_step_rule():
    assert threads_for_step("auto", 1, 8) == 1
    assert threads_for_step("auto", SMALL_STEP_TOKENS, 8) == 1
    assert threads_for_step("auto", SMALL_STEP_TOKENS + 1, 8) == 8
    assert threads_for_step(3, 1, 8) == 3
    with pytest.raises(ValueError, match="cpu_threads must be 'auto' or a positive integer"):
        LLM("tiny-py", cpu_threads=0)


def test_torch_threads_restores_even_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(1 if before > 1 else 2):
        assert torch.get_num_threads() != before
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


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
        assert torch.get_num_threads() == 2  # the caller's count is back after each step
        fixed = LLM("tiny-py", cpu_threads=2)
        seen.clear()
        fixed.model.register_forward_pre_hook(record)
        fixed.generate(["def"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert seen and all(threads == 2 for _, threads in seen)
    finally:
        torch.set_num_threads(before)
