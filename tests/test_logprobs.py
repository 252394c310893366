"""``SamplingParams(logprobs=k, prompt_logprobs=k)``: the model's raw log-probabilities, equal to HF's
log-softmax of its logits (fp32, 1e-4), however the work is split into steps."""

from __future__ import annotations

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.models import bundled_models_dir


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_models_dir() / "tiny-py", dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids), V): row i is the distribution of the token after ids[:i + 1]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_against_hf(out, hf, k_prompt: int | None, k_gen: int | None) -> None:
    ids = out.prompt_token_ids + out.token_ids
    table = hf_logprobs(hf, ids)
    n = len(out.prompt_token_ids)
    if k_prompt is not None:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        for i in range(1, n):
            got = out.prompt_logprobs[i]
            assert ids[i] in got and len(got) in (k_prompt, k_prompt + 1)
            top = set(table[i - 1].topk(k_prompt).indices.tolist()) if k_prompt else set()
            assert set(got) == top | {ids[i]}
            for token, value in got.items():
                assert value == pytest.approx(table[i - 1, token].item(), abs=1e-4)
    if k_gen is not None:
        assert len(out.logprobs) == len(out.token_ids)
        for j, token in enumerate(out.token_ids):
            got = out.logprobs[j]
            assert token in got and len(got) in (k_gen, k_gen + 1)
            for t, value in got.items():
                assert value == pytest.approx(table[n + j - 1, t].item(), abs=1e-4)


def prompts(llm: LLM) -> list[list[int]]:
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nclass Path:\n    pass\n" * 3
    ids = llm.tokenizer.encode(text)
    return [ids[:1], ids[:9], ids[4:60], ids[10:100]]


def test_logprobs_equal_hf_log_softmax(llm, hf):
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=1.3, seed=5, max_tokens=6, logprobs=0, prompt_logprobs=0),  # raw, not /T
              SamplingParams(temperature=0, max_tokens=6, logprobs=5),
              SamplingParams(temperature=0.7, top_k=3, seed=1, max_tokens=6, prompt_logprobs=4)]
    outs = llm.generate(prompts(llm), params, use_tqdm=False)
    for out, sp in zip(outs, params, strict=True):
        check_against_hf(out, hf, sp.prompt_logprobs, sp.logprobs)
    assert outs[2].prompt_logprobs is None and outs[3].logprobs is None


def test_chunked_prefill_preemption_and_prefix_caching_change_no_logprob(llm, hf):
    """Chunks score their own prompt tokens; a preempted request does not report them twice; a request
    asking for prompt logprobs skips the prefix cache (a cached token is never computed)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    config = EngineConfig(num_kv_blocks=16, block_size=8, max_num_batched_tokens=16)
    engine = Engine(llm.model, llm.tokenizer, config, llm.max_model_len, llm.engine.eos_token_ids, seed=0)
    batch = prompts(llm)
    for _ in range(2):  # the second round could hit the prefix cache
        states = [engine.make_request(p, params) for p in batch]
        for state in states:
            engine.add(state)
        while not all(s.finished for s in states):
            engine.step()
        for state in states:
            check_against_hf(state.to_output(), hf, 2, 2)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_bad_logprob_counts_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be None or an integer in \[0, 20\]"):
        SamplingParams(**{field: value})
