"""minipd's own model implementation against HF transformers, family by family.

Each family is built as a small random HF model, saved in HF format, loaded by minipd, and must give
the same logits (fp32 tolerance) and the same greedy continuation, token for token.
"""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_hf_model

from minipd import LLM, SamplingParams
from minipd.kv import ContiguousKVCache
from minipd.models import load_model

CASES = [
    ("llama", False, None),  # llama3 RoPE scaling
    ("llama", True, "60KB"),  # tied embeddings, sharded checkpoint
    ("mistral", False, None),  # sliding window shorter than the sequences
    ("qwen2", False, None),  # q/k/v biases
    ("qwen3", True, None),  # q/k RMSNorm, explicit head_dim, tied
    ("qwen3", False, "60KB"),
    ("llama-bias", False, None),  # attention_bias: q/k/v and o_proj biases
    ("mixtral", False, None),  # mixture of experts
    ("qwen2_moe", False, None),  # a gated shared expert, a dense layer, top-k not renormalised
    ("qwen3_moe", True, "60KB"),  # every other layer sparse, q/k norms, tied, sharded
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tied{c[1]}-shard{bool(c[2])}")
def models(request, tmp_path_factory):
    family, tie, shard = request.param
    folder = tmp_path_factory.mktemp(family)
    overrides = {"attention_bias": True} if family == "llama-bias" else {}
    hf = make_hf_model(folder, family.removesuffix("-bias"), tie=tie, max_shard_size=shard, **overrides)
    return hf, folder


def prompts(n: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (length,), generator=gen).tolist() for length in (5, 20, 47)[:n]]


def test_checkpoint_is_sharded_when_asked(models):
    _, folder = models
    sharded = (folder / "model.safetensors.index.json").exists()
    assert sharded == (len(list(folder.glob("*.safetensors"))) > 1)


def test_logits_match_hf(models):
    hf, folder = models
    ours, _ = load_model(folder, device="cpu", dtype=torch.float32)
    for ids in prompts():
        x = torch.tensor(ids)
        with torch.no_grad():
            expected = hf(x[None]).logits[0]
            got = ours.compute_logits(ours(x, torch.arange(len(ids))))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_incremental_decode_matches_full_forward(models):
    """Prefill of a prefix followed by one-token decode steps through the cache equals one full pass."""
    hf, folder = models
    ours, _ = load_model(folder, device="cpu")
    cfg = ours.config
    ids = torch.tensor(prompts()[2])
    cache = ContiguousKVCache(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim)
    with torch.no_grad():
        steps = [ours.compute_logits(ours(ids[:30], torch.arange(30), cache))]
        for t in range(30, len(ids)):
            steps.append(ours.compute_logits(ours(ids[t:t + 1], torch.tensor([t]), cache)))
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(torch.cat(steps), expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_hf_generate(models):
    hf, folder = models
    llm = LLM(folder, device="cpu")
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=32))
    for ids, out in zip(prompts(), outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        expected = ref[0, len(ids):].tolist()
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if expected[-1] == 0 and len(expected) < 32 else "length")


@pytest.mark.parametrize(("family", "sparse", "shared"), [("qwen2_moe", [True, False, True], True),
                                                         ("qwen3_moe", [False, True, False, True], False)])
def test_qwen_moe_layers_are_sparse_where_the_config_says(tmp_path, family, sparse, shared):
    """mlp_only_layers and decoder_sparse_step decide which layers route; Qwen2-MoE adds a gated shared
    expert; a checkpoint missing the shared expert's gate is refused by name."""
    from minipd.layers.moe import MoE

    make_hf_model(tmp_path, family)
    ours, _ = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert [isinstance(layer.mlp, MoE) for layer in ours.layers] == sparse
    moe = next(layer.mlp for layer in ours.layers if isinstance(layer.mlp, MoE))
    assert (moe.shared_expert is not None) == shared
    assert moe.router.renormalize == (family == "qwen3_moe")
    if shared:
        from safetensors.torch import load_file, save_file

        tensors = load_file(tmp_path / "model.safetensors")
        del tensors["model.layers.0.mlp.shared_expert_gate.weight"]
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=r"layers\.0\.mlp\.shared_expert_gate\.weight"):
            load_model(tmp_path, device="cpu")
