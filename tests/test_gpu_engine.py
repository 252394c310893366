"""The engine on CUDA: the same greedy tokens as on the CPU, through pinned input buffers and steps that
sample nothing (chunked prefill). Skipped, and reported as not run, where there is no GPU; the CPU path of the
same code is covered by tests/test_engine.py and tests/test_engine_seams.py."""

from __future__ import annotations

import pytest
import torch

from minipd import LLM, SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not run on this machine)")

PROMPTS = ["def fib(n):", "import ", "class Stack:\n    def push(self, item):", "for i in range(10):"] * 4


@cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_greedy_tokens_equal_the_cpu_ones(backend):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM("tiny-py", device="cpu").generate(PROMPTS, params)
    # fp32 on the GPU so tokens can be compared exactly; a small budget makes steps that sample nothing.
    gpu = LLM("tiny-py", device="cuda", dtype=torch.float32, kernel_backend=backend, max_num_batched_tokens=8,
              block_size=8).generate(PROMPTS, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@cuda
def test_cuda_bf16_runs_and_keeps_the_pool_whole():
    llm = LLM("tiny-py", device="cuda")
    assert llm.dtype == torch.bfloat16 and llm.engine.core.kernels.name == "triton"
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=32))
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert llm.engine.block_manager.num_used_blocks == 0


@cuda
def test_cuda_compiled_decode_captures_graphs_with_the_eager_tokens():
    # mode="reduce-overhead": each bucket is a CUDA graph replayed over the pool, which must not be copied.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 9, 17, 3)] * 4
    options = dict(device="cuda", dtype=torch.float32, max_model_len=128, max_num_seqs=16)
    eager = LLM("tiny-py", **options).generate(PROMPTS, params)
    llm = LLM("tiny-py", compile_decode=True, compile_batch_sizes=(4, 16), **options)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in eager]
    assert llm.engine.core.runner.compiled.compiled
