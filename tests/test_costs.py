"""minipd.sim.costs counts parameters, FLOPs and bytes exactly; minipd.viz.roofline draws what it is given."""

from __future__ import annotations

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from helpers import FAMILIES, hf_config

from minipd.config import ModelConfig
from minipd.kv.contiguous import ContiguousKVCache
from minipd.models.decoder import DecoderModel
from minipd.sim import costs
from minipd.viz.roofline import RooflinePoint, plot_roofline


def minipd_config(family: str, tie: bool = False, **overrides) -> ModelConfig:
    return ModelConfig.from_dict(hf_config(family, tie, **overrides).to_dict())


# --- parameters ---------------------------------------------------------------------------------

# Published totals (model cards / the safetensors index of each hub repository).
PUBLISHED = {"llama-3-8b": 8_030_261_248, "llama-2-7b": 6_738_415_616, "qwen3-0.6b": 596_049_920,
             "mixtral-8x7b": 46_702_792_704}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_published_parameter_counts(name: str) -> None:
    assert costs.count_parameters(costs.preset(name)).total == PUBLISHED[name]


def test_preset_details() -> None:
    qwen = costs.preset("qwen3-0.6b")
    assert (qwen.head_dim, qwen.tie_word_embeddings, qwen.qk_norm) == (128, True, True)
    assert costs.count_parameters(qwen).non_embedding == 440_467_456  # Qwen3 report: "0.44B non-embedding"
    # Mixtral: 2 of 8 experts per token, about 12.9B active parameters.
    assert costs.count_parameters(costs.preset("mixtral-8x7b")).active == 12_879_925_248
    with pytest.raises(ValueError, match="known: llama-3-8b"):
        costs.preset("gpt-5")


def test_deepseek_v3_and_qwen3_moe_presets() -> None:
    # DeepSeek-V3's report: 671B parameters, 37B activated per token (the MTP layer is not counted).
    ds = costs.preset("deepseek-v3")
    counts = costs.count_parameters(ds)
    assert 670e9 < counts.total < 672e9 and 37e9 < counts.active < 38e9
    assert [ds.layer_is_moe(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert (ds.n_group, ds.topk_group, ds.shared_expert_gated, ds.rope.rope_type) == (8, 4, False, "yarn")
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated.
    qwen = costs.count_parameters(costs.preset("qwen3-30b-a3b"))
    assert 30.4e9 < qwen.total < 30.6e9 and 3.3e9 < qwen.active < 3.4e9


def test_mla_caches_a_latent_per_token() -> None:
    ds = costs.preset("deepseek-v3")
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) in bf16, against K (128 + 64) and V (128) for 128 heads.
    assert costs.kv_bytes_per_token(ds) == ds.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert costs.mha_kv_bytes_per_token(ds) == 61 * 128 * (192 + 128) * 2 == 4_997_120
    assert costs.mha_kv_bytes_per_token(ds) / costs.kv_bytes_per_token(ds) == pytest.approx(71.1, abs=0.05)
    # Grouped-query attention's saving over MHA is its group size.
    llama = costs.preset("llama-3-8b")
    assert costs.mha_kv_bytes_per_token(llama) == 4 * costs.kv_bytes_per_token(llama)
    # A decode step reads each visible latent once per layer; the absorbed attention costs
    # 2 x heads x (576 + 512) FLOPs per (query, key, layer).
    step = costs.decode_cost(ds, batch=2, context=100)
    assert step.kv_read_bytes == 2 * 100 * 70_272 and step.kv_write_bytes == 2 * 70_272
    assert step.attention_flops == 2 * 128 * (576 + 512) * 2 * 100 * 61


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 24, "attention_bias": True, "first_k_dense_replace": 2}],
                         ids=["q-direct", "q-lora-bias"])
def test_deepseek_v3_parameter_counts_match_transformers(overrides: dict) -> None:
    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config("deepseek_v3", **overrides)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    counts = costs.count_parameters(cfg)
    groups = _hf_groups(model)
    assert {k: getattr(counts, k) for k in groups} == groups
    assert counts.total == sum(p.numel() for p in model.parameters())
    # minipd keeps the routers' correction bias as a (frozen) parameter; HF as a buffer.
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    ours = sum(p.numel() for p in DecoderModel(cfg).parameters())
    assert ours == counts.total + moe_layers * cfg.num_experts
    # Active: the dense layers whole; in the others the router, the shared expert and 2 of 8 experts.
    expert = 3 * 64 * 32
    assert counts.mlp - counts.mlp_active == moe_layers * (8 - 2) * expert


def _hf_groups(model: torch.nn.Module) -> dict[str, int]:
    """Parameters of an HF model by the part of the model they belong to, from their names."""
    groups = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    for name, p in model.named_parameters():  # a tied LM head is listed once, as the embedding
        if "embed_tokens" in name:
            groups["embedding"] += p.numel()
        elif name.startswith("lm_head"):
            groups["lm_head"] += p.numel()
        elif ".self_attn." in name:
            groups["attention"] += p.numel()
        elif ".mlp." in name or ".block_sparse_moe." in name:
            groups["mlp"] += p.numel()
        else:
            assert "norm" in name, name
            groups["norms"] += p.numel()
    return groups


CONFIGS = [(f, tie, {}) for f in FAMILIES for tie in (False, True)] + [
    ("llama", False, {"attention_bias": True}),  # q, k, v and o biases
    ("qwen3", True, {"attention_bias": True}),
    ("qwen2", False, {"num_key_value_heads": 8}),  # multi-head attention, q/k/v biases
]


@pytest.mark.parametrize(("family", "tie", "overrides"), CONFIGS)
def test_parameter_counts_match_transformers(family: str, tie: bool, overrides: dict) -> None:
    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config(family, tie, **overrides)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    counts = costs.count_parameters(ModelConfig.from_dict(hf_cfg.to_dict()))
    groups = _hf_groups(model)
    assert {k: getattr(counts, k) for k in groups} == groups
    assert counts.total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_match_minipd_model(family: str, tie: bool) -> None:
    cfg = minipd_config(family, tie)
    assert costs.count_parameters(cfg).total == sum(p.numel() for p in DecoderModel(cfg).parameters())


def test_parameter_counts_by_hand() -> None:
    # hf_config("llama"): vocab 320, hidden 64, MLP 96, 2 layers, 8 query heads and 2 KV heads of 8.
    counts = costs.count_parameters(minipd_config("llama"))
    assert counts.embedding == 320 * 64 == 20_480
    assert counts.attention == 2 * (64 * 64 + 2 * 64 * 16 + 64 * 64) == 20_480
    assert counts.mlp == counts.mlp_active == 2 * 3 * 64 * 96 == 36_864
    assert counts.norms == (2 * 2 + 1) * 64 == 320
    assert counts.lm_head == 20_480
    assert counts.total == counts.active == 98_624
    assert costs.matmul_weights_per_token(minipd_config("llama")) == 2 * (10_240 + 18_432)
    # Mixtral shape: 4 experts of 3*64*96, top-2, router 64*4 per layer.
    moe = costs.count_parameters(minipd_config("mixtral"))
    assert moe.mlp == 2 * (4 * 18_432 + 256)
    assert moe.mlp_active == 2 * (2 * 18_432 + 256)


# --- FLOPs and bytes by hand ----------------------------------------------------------------------


def test_decode_cost_by_hand() -> None:
    cfg = minipd_config("llama")  # untied; see test_parameter_counts_by_hand for the shape
    c = costs.decode_cost(cfg, batch=3, context=5, dtype_bytes=2)
    assert (c.num_tokens, c.num_sequences) == (3, 3)
    assert c.linear_flops == 2 * 3 * 57_344 == 344_064          # 2 FLOPs x 3 tokens x weights per token
    assert c.attention_flops == 4 * 64 * (3 * 5 * 2) == 7_680   # 4 x q_dim x (sequences x keys x layers)
    assert c.lm_head_flops == 2 * 3 * 64 * 320 == 122_880       # one row per sequence
    assert c.flops == 474_624
    assert c.weight_bytes == 2 * (57_664 + 20_480) == 156_288   # non-embedding params + LM head, bf16
    # K and V of 2 KV heads x 8 dims in bf16 = 64 bytes per token per layer.
    assert c.kv_read_bytes == 64 * 5 * 3 * 2 == 1_920
    assert c.kv_write_bytes == 64 * 3 * 2 == 384
    # Per token and layer: qkv 64 in + 96 out, attention 64 + 64, o 64 + 64, MLP 64 + 192 + 96 + 64 = 832;
    # plus the embedding row (64) per token and the LM head's 64 in + 320 out per sequence.
    assert c.activation_bytes == 2 * (3 * (2 * 832 + 64) + 3 * (64 + 320)) == 12_672
    assert c.bytes == 156_288 + 1_920 + 384 + 12_672
    assert c.arithmetic_intensity == pytest.approx(474_624 / c.bytes)


def test_prefill_cost_by_hand() -> None:
    cfg = minipd_config("llama")
    c = costs.prefill_cost(cfg, 4, dtype_bytes=4)
    assert c.linear_flops == 2 * 4 * 57_344
    assert c.attention_flops == 4 * 64 * (1 + 2 + 3 + 4) * 2   # the causal triangle in each layer
    assert c.lm_head_flops == 2 * 64 * 320                     # only the last position samples
    assert c.kv_read_bytes == c.kv_write_bytes == 128 * 4 * 2  # fp32: 128 bytes per token per layer
    # A chunk after 6 cached tokens: queries at positions 6..9 see 7..10 keys; all 10 are read.
    chunk = costs.prefill_cost(cfg, 4, cached=6, dtype_bytes=4)
    assert chunk.attention_flops == 4 * 64 * (7 + 8 + 9 + 10) * 2
    assert chunk.kv_read_bytes == 128 * 10 * 2 and chunk.kv_write_bytes == 128 * 4 * 2


def test_step_cost_adds_up_its_sequences() -> None:
    cfg = minipd_config("qwen3", tie=True)
    mixed = costs.step_cost(cfg, [(9, 1), (0, 7), (4, 1)])
    d = costs.decode_cost(cfg, 2, [10, 5])
    p = costs.prefill_cost(cfg, 7)
    assert mixed.attention_flops == d.attention_flops + p.attention_flops
    assert mixed.linear_flops == d.linear_flops + p.linear_flops
    assert mixed.kv_read_bytes == d.kv_read_bytes + p.kv_read_bytes
    assert mixed.weight_bytes == d.weight_bytes == p.weight_bytes  # weights are read once per step
    # Tied: the LM head is the embedding table, so the step reads every parameter once.
    assert d.weight_bytes == 2 * costs.count_parameters(cfg).total


def test_sliding_window_caps_keys() -> None:
    cfg = minipd_config("mistral")  # every layer sees at most 24 keys
    q_dim = 8 * 8
    assert costs.decode_cost(cfg, 1, 100).attention_flops == 4 * q_dim * 24 * 2
    assert costs.decode_cost(cfg, 1, 100).kv_read_bytes == 64 * 24 * 2
    assert costs.prefill_cost(cfg, 30).attention_flops == 4 * q_dim * (24 * 25 // 2 + 24 * 6) * 2
    # A chunk of 3 after 40 cached: the queries' windows together span positions 17..42.
    assert costs.prefill_cost(cfg, 3, cached=40).kv_read_bytes == 64 * 26 * 2


def test_sum_min_closed_form() -> None:
    for cap in (None, 1, 5, 12):
        for first in range(1, 15):
            for last in range(first - 1, 20):
                brute = sum(p if cap is None else min(p, cap) for p in range(first, last + 1))
                assert costs._sum_min(first, last, cap) == brute


def test_mixture_of_experts_reads_only_routed_experts() -> None:
    cfg = minipd_config("mixtral")  # 4 experts, top-2
    expert_bytes = 2 * 3 * 64 * 96 * 2  # two layers, bf16
    one = costs.decode_cost(cfg, 1, 8)
    many = costs.decode_cost(cfg, 4, 8)
    assert many.weight_bytes - one.weight_bytes == 2 * expert_bytes  # 2 experts -> all 4
    assert costs.decode_cost(cfg, 16, 8).weight_bytes == many.weight_bytes
    assert one.linear_flops == 2 * costs.matmul_weights_per_token(cfg)


def test_kv_bytes_per_token_matches_the_caches() -> None:
    cfg = minipd_config("qwen3")  # head_dim 16, not hidden / heads
    assert costs.kv_bytes_per_token(cfg, 2) == cfg.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
    cache = ContiguousKVCache(cfg.num_hidden_layers, 10, cfg.num_key_value_heads, cfg.head_dim)
    assert cache.nbytes == 10 * costs.kv_bytes_per_token(cfg, 4)
    llama3 = costs.preset("llama-3-8b")
    assert costs.kv_bytes_per_token(llama3) == 131_072  # 128 KiB per token in bf16


def test_invalid_steps_are_refused() -> None:
    cfg = minipd_config("llama")
    with pytest.raises(ValueError, match="2 context lengths for a batch of 3"):
        costs.decode_cost(cfg, 3, [4, 5])
    with pytest.raises(ValueError, match="at least 1"):
        costs.decode_cost(cfg, 1, 0)
    with pytest.raises(ValueError, match="new >= 1"):
        costs.step_cost(cfg, [(3, 0)])
    with pytest.raises(ValueError, match="at least one"):
        costs.step_cost(cfg, [])


# --- against torch's own FLOP counter -----------------------------------------------------------


def _counted_flops(model: DecoderModel, ids: torch.Tensor, positions: torch.Tensor, cache: ContiguousKVCache) -> int:
    """FLOPs torch counts for one forward step and the last row's logits; attention via the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        hidden = model(ids, positions, cache)
        model.compute_logits(hidden[-1:])
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_flops_match_torch_flop_counter(family: str) -> None:
    torch.manual_seed(0)
    cfg = minipd_config(family, tie=family == "qwen3")
    model = DecoderModel(cfg).eval()
    cache = ContiguousKVCache(cfg.num_hidden_layers, 32, cfg.num_key_value_heads, cfg.head_dim)
    prompt = 9
    counted = _counted_flops(model, torch.arange(prompt), torch.arange(prompt), cache)
    cost = costs.prefill_cost(cfg, prompt)
    q_dim = cfg.num_attention_heads * cfg.head_dim
    # The math backend computes the whole score matrix and masks it afterwards; we count only the triangle.
    full_square = 4 * q_dim * prompt * prompt * cfg.num_hidden_layers
    if not cfg.is_moe:  # routed experts' FLOPs depend on how the tokens happened to spread over them
        assert counted == cost.linear_flops + cost.lm_head_flops + full_square
    counted = _counted_flops(model, torch.tensor([5]), torch.tensor([prompt]), cache)
    assert counted == costs.decode_cost(cfg, 1, prompt + 1).flops


# --- devices and intensity ------------------------------------------------------------------------


def test_devices_and_the_roofline() -> None:
    assert costs.H100_SXM.ridge_point == pytest.approx(989 / 3.35, rel=1e-12)
    assert costs.H200.mem_bandwidth == 4.8e12 and costs.H200.peak_flops == costs.H100_SXM.peak_flops
    assert costs.H100_SXM.attainable_flops(1.0) == 3.35e12
    assert costs.H100_SXM.attainable_flops(1e4) == 989e12
    assert costs.arithmetic_intensity(3, 2) == 1.5


def test_decode_is_memory_bound_and_prefill_compute_bound_on_an_h100() -> None:
    llama = costs.preset("llama-3-8b")
    prefill = costs.prefill_cost(llama, 2048)
    decode = costs.decode_cost(llama, 1, 2048)
    assert prefill.bound_on(costs.H100_SXM) == "compute"
    assert decode.bound_on(costs.H100_SXM) == "memory"
    assert decode.arithmetic_intensity < 2  # ~1 FLOP per byte: 2 FLOPs per 2-byte weight
    # Batching shares the weights, so intensity grows with the batch at short context...
    assert costs.decode_cost(llama, 64, 128).arithmetic_intensity > 40
    # ...but each sequence brings its own KV cache, so at long context it saturates.
    # The limit: per sequence, 2 FLOPs per weight plus attention, over its 8192 tokens of K/V.
    long = [costs.decode_cost(llama, b, 8192).arithmetic_intensity for b in (64, 256, 1024)]
    per_seq_flops = 2 * (costs.matmul_weights_per_token(llama) + 4096 * 128256) + 4 * 4096 * 8192 * 32
    limit = per_seq_flops / (8192 * costs.kv_bytes_per_token(llama))
    assert long[0] < long[1] < long[2] < limit < 18 < costs.H100_SXM.ridge_point
    assert limit - long[2] < 1
    step = decode.time_on(costs.H100_SXM)
    assert step == pytest.approx(decode.bytes / 3.35e12)


# --- the roofline plot ----------------------------------------------------------------------------


def test_plot_roofline_draws_roofs_and_points() -> None:
    cpu = costs.DeviceSpec("cpu", 1e11, 2e10, "measured")
    ax = plot_roofline([cpu, costs.H100_SXM], [
        RooflinePoint("decode", 1.0),
        RooflinePoint("prefill on H100", 400.0, devices=("H100 SXM",)),
        RooflinePoint("measured", 3.0, flops_per_s=2e10),
    ])
    lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    x, y = lines["roof:cpu"].get_data()
    assert y.max() == 1e11 and y.min() == pytest.approx(x.min() * 2e10)
    points = {c.get_gid(): c.get_offsets() for c in ax.collections}
    assert points["point:decode"].tolist() == [[1.0, 2e10], [1.0, 3.35e12]]
    assert points["point:prefill on H100"].tolist() == [[400.0, 989e12]]
    assert points["point:measured"].tolist() == [[3.0, 2e10]]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    plt.close("all")


def test_plot_roofline_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one DeviceSpec"):
        plot_roofline([])
    with pytest.raises(ValueError, match="not plotted: H200"):
        plot_roofline([costs.H100_SXM], [RooflinePoint("x", 1.0, devices=("H200",))])
    plt.close("all")
