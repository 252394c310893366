"""The two kernel backends give the same tokens end to end (Triton under its interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.kernels.backend import default_backend_name, get_backend

PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "class Stack:\n    def push(self, item):"]


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=8, block_size=8)],
                         ids=["default", "chunked-prefill"])
def test_greedy_tokens_equal_on_both_backends(options):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM("tiny-py", kernel_backend=backend, **options)
        assert llm.engine.core.kernels.name == backend
        outputs[backend] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert outputs["torch"] == outputs["triton"]


def test_default_backend_follows_the_device():
    from minipd.kernels.cpu_paged_attention import kernel_built

    # On a CPU: the compiled C++ kernel once built (make install builds it), the torch reference before.
    expected = "cpu" if kernel_built() else "torch"
    assert default_backend_name(torch.device("cpu")) == expected
    assert get_backend(None, torch.device("cpu")).name == expected
    if torch.cuda.is_available():
        assert default_backend_name(torch.device("cuda")) == "triton"
    else:
        print("CUDA default (triton) not checked: no GPU here")
