"""The sampling fields a server needs: penalties and ``min_tokens`` against HF's logits processors and
``generate``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``n`` refused clearly, and every
validation error naming its field in ``param``."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_hf_model

from minipd import LLM, SamplingParams
from minipd.errors import ParameterError
from minipd.layers.sampler import apply_penalties


@pytest.fixture(scope="module")
def hf_and_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = make_hf_model(folder, "llama", max_position_embeddings=96)
    return hf, LLM(folder, device="cpu", seed=0)


PROMPTS = [[5, 17, 42, 99, 3, 8], [250, 251, 7], list(range(30, 50))]


def hf_generate(hf, ids: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def test_repetition_penalty_and_min_tokens_equal_hf_processors():
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator) * 4
    prompts, outputs = [[1, 2, 3, 3], [7], [9, 10]], [[4, 4, 1], [], [11]]
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6, min_tokens=2),
              SamplingParams(min_tokens=1, stop_token_ids=[5])]
    got = apply_penalties(logits, params, prompts, outputs, [{0}, {0}, {0}])
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        row = logits[i:i + 1].clone()
        if params[i].repetition_penalty != 1:
            row = RepetitionPenaltyLogitsProcessor(params[i].repetition_penalty)(ids, row)
        if params[i].min_tokens:
            stops = [0, *(params[i].stop_token_ids or [])]
            row = MinNewTokensLengthLogitsProcessor(len(prompts[i]), params[i].min_tokens, stops)(ids, row)
        torch.testing.assert_close(got[i], row[0], rtol=0, atol=0)
    assert apply_penalties(logits, [SamplingParams()] * 3, prompts, outputs, [{0}] * 3) is logits  # untouched


def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = torch.zeros(1, 8)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, [p], [[6, 6, 6]], [[1, 1, 1, 2]], [set()])[0]
    # Output counts: token 1 three times, token 2 once; prompt tokens are not counted.
    assert got.tolist() == [0, -(0.25 * 3 + 0.5), -(0.25 + 0.5), 0, 0, 0, 0, 0]


def test_penalised_greedy_generation_equals_hf_generate(hf_and_llm):
    hf, llm = hf_and_llm
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5)
    outputs = llm.generate(PROMPTS, params)
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_generate(hf, ids, max_new_tokens=24, repetition_penalty=1.5)[:len(out.token_ids)]
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outputs] != [o.token_ids for o in plain]  # the penalty changed something


def test_min_tokens_holds_back_stop_tokens_as_hf_min_new_tokens_does(hf_and_llm):
    hf, llm = hf_and_llm
    greedy = SamplingParams(temperature=0, max_tokens=12)
    for ids in PROMPTS:
        first = llm.generate([ids], greedy)[0].token_ids[0]
        # Stopping at the greedy first token would end the request at once; min_tokens=3 forbids it.
        early = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first]))[0]
        assert early.token_ids == [first] and early.finish_reason == "stop"
        held = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, min_tokens=3,
                                                  stop_token_ids=[first]))[0]
        expected = hf_generate(hf, ids, max_new_tokens=12, min_new_tokens=3, eos_token_id=[0, first])
        assert held.token_ids == expected[:len(held.token_ids)] and len(held.token_ids) >= 3
        assert first not in held.token_ids[:3]


def test_a_seeded_penalised_request_is_repeatable_and_penalties_cut_repeats(hf_and_llm):
    _, llm = hf_and_llm
    base = dict(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    plain = llm.generate(PROMPTS, SamplingParams(**base))
    penalised = [llm.generate(PROMPTS, SamplingParams(**base, frequency_penalty=2.0, presence_penalty=2.0))
                 for _ in range(2)]
    assert [o.token_ids for o in penalised[0]] == [o.token_ids for o in penalised[1]]

    def repeats(outputs) -> int:
        return sum(len(o.token_ids) - len(set(o.token_ids)) for o in outputs)

    assert repeats(penalised[0]) < repeats(plain)


def test_include_stop_str_and_skip_special_tokens(hf_and_llm):
    tiny = LLM("tiny-py")
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    full = tiny.generate("def parse(self, text):", SamplingParams(**greedy))[0]
    stop = full.text.strip()[3:6]
    assert len(stop) == 3 and stop in full.text
    cut = tiny.generate("def parse(self, text):", SamplingParams(**greedy, stop=stop))[0]
    kept = tiny.generate("def parse(self, text):", SamplingParams(**greedy, stop=stop, include_stop_str_in_output=True))
    start = full.text.index(stop)
    assert cut.text == full.text[:start] and cut.finish_reason == "stop"
    assert kept[0].text == full.text[:start + len(stop)] and kept[0].finish_reason == "stop"
    early = tiny.generate("def parse(self, text):", SamplingParams(**greedy, stop=full.text[:2], min_tokens=6))[0]
    assert len(early.token_ids) >= 6  # as vLLM: no stop string ends a request before min_tokens
    _, llm = hf_and_llm
    eos = 0  # the test tokenizer's <eos>, a special token
    with_special = llm.tokenizer.decode([eos, *full.token_ids[:3]], skip_special_tokens=False)
    assert "<eos>" in with_special and "<eos>" not in llm.tokenizer.decode([eos, *full.token_ids[:3]])
    shown = llm.generate([[*PROMPTS[0], eos]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                              skip_special_tokens=False))[0]
    hidden = llm.generate([[*PROMPTS[0], eos]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert shown.token_ids == hidden.token_ids
    assert shown.text == llm.tokenizer.decode(shown.token_ids, skip_special_tokens=False)
    assert hidden.text == llm.tokenizer.decode(hidden.token_ids)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"),
        (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"), (dict(ignore_eos=1), "ignore_eos"), (dict(logprobs=99), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(n=2), "n"), (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
    ],
)
def test_every_sampling_error_names_its_field(kwargs, param):
    with pytest.raises(ParameterError, match=param) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == param
    assert isinstance(caught.value, ValueError)


def test_chat_renders_the_bundled_template_and_equals_generate_on_its_text():
    tiny = LLM("tiny-py")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    conversation = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a sort\nplease"}]
    text = tiny.tokenizer.apply_chat_template(conversation)
    assert text == "# system: You write Python.\n# user: a sort\n# please\n# assistant:\n"
    (reply,) = tiny.chat(conversation, greedy)
    assert reply.token_ids == tiny.generate(text, greedy)[0].token_ids and reply.prompt == text
    assert len(tiny.chat([conversation, conversation[1:]], greedy)) == 2
    for bad, param in [([], "messages"), ([{"role": "user"}], "messages[0]"), ([{"role": 1, "content": "x"}],
                                                                                "messages[0]")]:
        with pytest.raises(ParameterError) as refused:
            tiny.chat(bad, greedy)
        assert refused.value.param == param
