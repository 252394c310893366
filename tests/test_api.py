"""The public API: LLM.generate / LLM.stream, SamplingParams, RequestOutput, and input checking."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_hf_model

from minipd import LLM, RequestOutput, SamplingParams
from minipd.kernels.backend import BACKENDS


@pytest.fixture(scope="module")
def hf_and_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = make_hf_model(folder, "llama", max_position_embeddings=64)
    return hf, LLM(folder, device="cpu", seed=0)


@pytest.fixture(scope="module")
def llm(hf_and_llm):
    return hf_and_llm[1]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.stop, p.ignore_eos, p.seed) == (
        1.0, -1, 1.0, 16, None, False, None)
    assert SamplingParams(stop="x").stop_strings == ["x"]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "prompts must not be empty"),
        ([""], r"prompts\[0\] is an empty string"),
        (["ok", []], r"prompts\[1\] is empty"),
        ([[1, 2, VOCAB]], rf"token id {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"),
        ([[1, -3]], "token id -3"),
        ([list(range(1, 65))], "at most 63"),
        (42, "prompts must be"),
    ],
)
def test_bad_prompts_are_rejected_and_the_llm_keeps_working(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)
    out = llm.generate("def add", GREEDY)
    assert len(out) == 1 and len(out[0].token_ids) == 12


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate(["a", "b"], [GREEDY])


def test_unknown_model_lists_bundled_models():
    with pytest.raises(ValueError, match="tiny-py"):
        LLM("no-such-model")


def test_outputs_in_order_with_one_params_per_prompt(hf_and_llm):
    hf, llm = hf_and_llm
    prompts = ["import os", [5, 6, 7, 8], "for i in range(10):"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [3, 7, 5]
    assert all(isinstance(o, RequestOutput) and o.finish_reason == "length" for o in outputs)
    assert outputs[1].prompt_token_ids == [5, 6, 7, 8] and outputs[1].prompt is None
    assert outputs[0].prompt == "import os"
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("import os")
    # Greedy output equals HF generate on the same ids.
    ids = outputs[2].prompt_token_ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert outputs[2].token_ids == ref[0, len(ids):].tolist()
    assert outputs[2].text == llm.tokenizer.decode(outputs[2].token_ids)


def test_single_token_id_prompt_is_one_request(llm):
    assert len(llm.generate([3, 4, 5], GREEDY)) == 1


def test_same_seed_same_output_and_different_seeds_differ(llm):
    def sample(seed):
        p = SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True)
        return llm.generate("import", p)[0].token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_seeded_request_does_not_depend_on_its_neighbours(llm):
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True)
    alone = llm.generate("x = 1", p)[0].token_ids
    together = llm.generate(["abc", "x = 1"], [SamplingParams(temperature=1.0, max_tokens=5), p])[1].token_ids
    assert alone == together


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("def", GREEDY)[0].token_ids
    top1 = llm.generate("def", SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=1))
    assert top1[0].token_ids == greedy


def test_stream_yields_the_same_tokens_as_generate(llm):
    deltas = list(llm.stream("class Path", GREEDY))
    final = llm.generate("class Path", GREEDY)[0]
    assert [d.token_id for d in deltas] == final.token_ids
    assert "".join(d.text for d in deltas) == deltas[-1].output.text
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]


def test_stop_token_ids_and_eos(llm):
    tokens = llm.generate("def", GREEDY)[0].token_ids
    stopper = tokens[4]
    first = tokens.index(stopper)
    out = llm.generate("def", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stopper]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stopper
    assert out.token_ids == tokens[: first + 1]


def test_stop_string_cuts_the_text(llm):
    full = llm.generate("import os", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate("import os", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    streamed = "".join(d.text for d in llm.stream("import os", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=stop)))
    assert streamed == out.text


def test_generation_stops_at_the_context_length(llm):
    out = llm.generate([list(range(1, 60))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64
    assert out.finish_reason == "length"


def test_metrics(llm):
    out = llm.generate("def add(a, b):", GREEDY)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 12 and m.token_times == sorted(m.token_times)
    assert m.ttft == pytest.approx(m.first_token_time - m.arrival_time)
    assert m.tpot == pytest.approx((m.token_times[-1] - m.token_times[0]) / 11)
    assert len(m.inter_token_latencies) == 11
    assert m.prefill_tokens == len(out.prompt_token_ids)


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_in_full(llm):
    prompt = list(range(1, 40))
    llm.generate([prompt], GREEDY)
    repeat = llm.generate([prompt], GREEDY)[0]
    assert repeat.metrics.cached_tokens > 0
    assert llm.reset_prefix_cache()
    fresh = llm.generate([prompt], GREEDY)[0]
    assert fresh.metrics.cached_tokens == 0 and fresh.metrics.prefill_tokens == len(prompt)
    assert fresh.token_ids == repeat.token_ids
    stream = llm.stream(prompt, GREEDY)
    next(stream)  # admitted and holding blocks: the cache cannot be emptied under it
    assert not llm.reset_prefix_cache()
    assert len([delta for delta in stream]) >= 1
    assert llm.reset_prefix_cache()


def test_max_model_len_is_checked(tmp_path):
    make_hf_model(tmp_path, "llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tmp_path, max_model_len=65)
    small = LLM(tmp_path, max_model_len=16)
    with pytest.raises(ValueError, match="at most 15"):
        small.generate([list(range(1, 17))], GREEDY)


def test_top_p_one_and_top_k_minus_one_filter_nothing():
    from minipd.layers.sampler import top_k_top_p_filter

    logits = torch.randn(3, 4096) * 8
    same = top_k_top_p_filter(logits, torch.tensor([-1, -1, -1]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(same, logits)
    mixed = top_k_top_p_filter(logits, torch.tensor([-1, 5, -1]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.isfinite(mixed[0]).all()
    assert int(torch.isfinite(mixed[1]).sum()) == 5
    kept = torch.isfinite(mixed[2])
    probs = logits[2].softmax(-1)
    assert probs[kept].sum() >= 0.5 and probs[kept].sum() - probs[kept].min() < 0.5


def test_the_repr_says_what_the_engine_really_runs_with():
    llm = LLM("tiny-py", linear_backend="torch", kv_cache_dtype="int8", num_kv_blocks=64)
    info = llm.describe()
    assert info["model"] == "tiny-py" and info["linear_backend"] == "torch" and info["kv_cache_dtype"] == "int8"
    assert info["num_kv_blocks"] == 64 and info["kernel_backend"] in BACKENDS
    assert info["compile_decode"] == "off (auto: a short-lived engine (long_lived=False); compile_decode=True compiles)"
    assert LLM("tiny-py-moe", record_routing=True, long_lived=True).describe()["compile_decode"] == \
        "off (auto: the compiled step does not cover record_routing)"
    assert repr(llm).startswith("LLM(model='tiny-py'") and "linear_backend='torch'" in repr(llm)
    auto = LLM("tiny-py").describe()
    assert auto["kv_cache_dtype"] == "float32"
    assert auto["linear_backend"] in ("torch", "onednn", "cpu")  # "auto" resolved
