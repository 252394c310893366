"""minipd.sim.roofline: an O(1) step-time model that agrees with minipd.sim.costs, with tensor parallelism;
and the presets it needs (OPT, Llama-3-70B, the A100)."""

from __future__ import annotations

import time

import pytest

from minipd.config import ModelConfig
from minipd.engine.stats import StepWork
from minipd.sim import costs
from minipd.sim.roofline import IB_400G, NVLINK3, NVLINK4, PCIE5_X16, Link, RooflineStepTime

LLAMA = costs.preset("llama-3-8b")


def exact(config: ModelConfig, device: costs.DeviceSpec = costs.H100_SXM, **options) -> RooflineStepTime:
    """The model at the datasheet's peaks with no overhead: the plain roofline."""
    return RooflineStepTime(config, device, compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.0,
                            **options)


def work_of(chunks: list[tuple[int, int]], decodes: list[int]) -> StepWork:
    """The StepWork of prefill chunks given as ``step_cost``'s (cached, new) and decode rows at the contexts."""
    return StepWork.of(tuple((new, cached + new) for cached, new in chunks), len(decodes), sum(decodes))


def cost_of(config: ModelConfig, chunks: list[tuple[int, int]], decodes: list[int]) -> costs.StepCost:
    return costs.step_cost(config, [*chunks, *[(c - 1, 1) for c in decodes]])


BATCHES = {
    "prefill-2048": ([(0, 2048)], []),
    "prefill-4x512": ([(0, 512)] * 4, []),
    "chunk-after-cache": ([(3000, 256)], []),
    "unequal-chunks": ([(0, 700), (100, 300), (2000, 48)], []),
    "decode-1": ([], [1024]),
    "decode-32": ([], [1024] * 32),
    "decode-mixed-contexts": ([], [17, 500, 4000, 8000]),
    "mixed": ([(1000, 512)], [200, 3000, 64]),
    "mixed-unequal": ([(0, 100), (50, 900)], [10] * 16),
}


# --- (a) agreement with step_cost -------------------------------------------------------------------


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_agrees_with_step_cost_for_a_dense_model(batch: str) -> None:
    chunks, decodes = BATCHES[batch]
    model = exact(LLAMA)
    work, cost = work_of(chunks, decodes), cost_of(LLAMA, chunks, decodes)
    assert model.step_time(work) == pytest.approx(cost.time_on(costs.H100_SXM), rel=0.02)
    flops, moved = model.flops_and_bytes(work)
    assert flops == pytest.approx(cost.flops, rel=1e-9)  # FLOPs are exact: pairs are all they need
    assert moved == pytest.approx(cost.bytes, rel=0.02)
    if len({new for _, new in chunks}) <= 1:  # one chunk size: the chunks' ends are recovered exactly
        assert moved == pytest.approx(cost.bytes, rel=1e-9)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("batch", sorted(b for b in BATCHES if b != "unequal-chunks" and b != "mixed-unequal"))
def test_moe_reads_the_expected_experts_at_most_the_upper_bound(name: str, batch: str) -> None:
    config = costs.preset(name)
    chunks, decodes = BATCHES[batch]
    model = exact(config)
    work, cost = work_of(chunks, decodes), cost_of(config, chunks, decodes)
    flops, moved = model.flops_and_bytes(work)
    assert flops == pytest.approx(cost.flops, rel=1e-9)
    assert moved <= cost.bytes * (1 + 1e-12)
    assert model.step_time(work) <= cost.time_on(costs.H100_SXM) * (1 + 1e-12)
    tokens_x_k = work.num_tokens * config.num_experts_per_tok
    if tokens_x_k == config.num_experts_per_tok or tokens_x_k >= 30 * config.num_experts:
        # One token reads exactly its k experts; thousands of routed slots read every expert.
        assert moved == pytest.approx(cost.bytes, rel=1e-9)


def test_expected_distinct_experts() -> None:
    config = costs.preset("qwen3-30b-a3b")  # 128 experts, top-8, in all 48 layers
    model = exact(config)
    expert_bytes = 48 * costs._expert_params(config) * 2

    def weight_bytes(tokens: int) -> float:  # decode rows at context 1: less the K/V read and the per-row bytes
        moved = model.flops_and_bytes(StepWork(decode_rows=tokens, decode_context=tokens))[1]
        return moved - tokens * (model.kv_bytes_per_token + model._bytes_token + model._bytes_row)

    # Two tokens: 128 (1 - (120/128)^2) = 15.5 experts expected, not the bound's 16.
    assert weight_bytes(2) - weight_bytes(1) == pytest.approx((128 * (1 - (120 / 128) ** 2) - 8) * expert_bytes)
    assert weight_bytes(32) - weight_bytes(1) == pytest.approx((128 * (1 - (120 / 128) ** 32) - 8) * expert_bytes)


# --- (b) tensor parallelism -------------------------------------------------------------------------


def test_tensor_parallelism_halves_compute_and_adds_all_reduces() -> None:
    work = work_of([(0, 8192)], [])
    one, two = exact(LLAMA), exact(LLAMA, tp=2)
    assert one.bound(work) == two.bound(work) == "compute"
    assert one.all_reduce_time(work) == 0.0
    assert two.step_time(work) - two.all_reduce_time(work) == pytest.approx(one.step_time(work) / 2, rel=1e-12)
    # Two all-reduces per layer of 8192 tokens x 4096 x 2 bytes, a ring of 2 over NVLink 4.
    ring = NVLINK4.latency_s + 2 * 1 / 2 * 8192 * 4096 * 2 / NVLINK4.bandwidth
    assert two.all_reduce_time(work) == pytest.approx(2 * 32 * ring, rel=1e-12)
    assert NVLINK4.all_reduce_time(1e6, 1) == 0.0


def test_all_reduce_grows_with_tp_and_shrinks_with_bandwidth() -> None:
    work = work_of([(0, 2048)], [100] * 8)
    by_tp = [exact(LLAMA, tp=tp).all_reduce_time(work) for tp in (2, 4, 8)]
    assert 0 < by_tp[0] < by_tp[1] < by_tp[2]
    by_link = [exact(LLAMA, tp=4, interconnect=link).all_reduce_time(work) for link in (NVLINK4, PCIE5_X16, IB_400G)]
    assert by_link[0] < by_link[1] < by_link[2]
    slow = Link("slow", 1e9, 0.0)
    # Two per layer, each 2 (4 - 1) / 4 of 2056 tokens x 4096 x 2 bytes through a 1 GB/s link.
    assert exact(LLAMA, tp=4, interconnect=slow).all_reduce_time(work) == pytest.approx(
        2 * 32 * 2 * 3 / 4 * 2056 * 4096 * 2 / 1e9)
    # The A100's own NVLink is the default there; NVLink 4 elsewhere.
    assert RooflineStepTime(LLAMA, costs.A100_80GB, tp=2).interconnect == NVLINK3
    assert RooflineStepTime(LLAMA, costs.H200, tp=2).interconnect == NVLINK4


def test_kv_heads_split_then_replicate() -> None:
    total = costs.kv_bytes_per_token(LLAMA)  # 8 KV heads
    assert [exact(LLAMA, tp=tp).kv_bytes_per_token for tp in (1, 2, 8, 16)] == [total, total / 2, total / 8,
                                                                                total / 8]
    ds = costs.preset("deepseek-v3")  # MLA's latent is replicated on every device
    assert exact(ds, tp=8).kv_bytes_per_token == costs.kv_bytes_per_token(ds)
    assert exact(LLAMA, kv_dtype_bytes=1).kv_bytes_per_token == total / 2


# --- (c) memory- and compute-bound -----------------------------------------------------------------


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    model = RooflineStepTime(LLAMA, costs.H100_SXM)
    assert model.bound(work_of([], [1024])) == "memory"
    assert model.bound(work_of([(0, 2048)], [])) == "compute"
    # Batch-1 decode reads the weights once (all but the embedding table, whose one row is looked up):
    # 15.01 GB at 80% of 3.35 TB/s, plus the 1 ms overhead.
    read = 2 * (8_030_261_248 - 128256 * 4096)
    assert model.step_time(work_of([], [1024])) == pytest.approx(read / (0.8 * 3.35e12) + 1e-3, rel=0.01)
    # An empty step is free; the defaults are the documented ones.
    assert model.step_time(StepWork()) == 0.0
    assert "llama-3-8b on 1× H100 SXM: compute 60% and memory 80% of peak, 1 ms" in model.describe()


# --- (d) KV capacity -------------------------------------------------------------------------------


def test_kv_capacity() -> None:
    weights = 2 * 8_030_261_248
    model = RooflineStepTime(LLAMA, costs.H100_SXM)
    assert model.weight_bytes_per_device == weights
    assert model.kv_bytes_per_token == 131_072
    assert model.kv_capacity_tokens() == model.kv_capacity_tokens(80e9) == int((80e9 * 0.9 - weights) // 131_072)
    assert model.kv_capacity_tokens(80e9) == 426_784
    assert RooflineStepTime(LLAMA, costs.H100_SXM, tp=2).kv_capacity_tokens(80e9) == \
        int((2 * 80e9 * 0.9 - weights) // 131_072)
    assert model.kv_capacity_tokens(80e9, reserve_fraction=0.0) > model.kv_capacity_tokens(80e9)
    # Llama-3-70B's 141 GB of weights do not fit one 80 GB device; on two there is room for ~9,000 tokens.
    big = costs.preset("llama-3-70b")
    assert RooflineStepTime(big, costs.H100_SXM).kv_capacity_tokens() == 0
    assert 8_000 < RooflineStepTime(big, costs.H100_SXM, tp=2).kv_capacity_tokens() < 10_000
    assert RooflineStepTime(big, costs.H200, tp=2).kv_capacity_tokens() == \
        int((2 * 141e9 * 0.9 - 2 * 70_553_706_496) // (80 * 2 * 8 * 128 * 2)) == 343_910
    with pytest.raises(ValueError, match="memory"):
        RooflineStepTime(LLAMA, costs.DeviceSpec("cpu", 1e12, 1e11)).kv_capacity_tokens()


def test_devices() -> None:
    assert (costs.A100_80GB.peak_flops, costs.A100_80GB.mem_bandwidth, costs.A100_80GB.memory_bytes) == \
        (312e12, 2.039e12, 80e9)
    assert (costs.H100_SXM.memory_bytes, costs.H200.memory_bytes) == (80e9, 141e9)
    # memory_bytes is the last field, with a default: positional construction is as before.
    assert costs.DeviceSpec("x", 1.0, 2.0, "measured").memory_bytes == 0.0


def test_invalid_arguments_are_refused() -> None:
    for options in ({"tp": 0}, {"compute_efficiency": 0.0}, {"memory_efficiency": 1.5}, {"step_overhead_s": -1}):
        with pytest.raises(ValueError):
            RooflineStepTime(LLAMA, costs.H100_SXM, **options)


# --- (e) presets: OPT and Llama-3-70B, counted exactly ---------------------------------------------


def _opt_total(hidden: int, layers: int, ffn: int, vocab: int = 50272, positions: int = 2048) -> int:
    """OPT's parameters by hand from its modules (transformers' OPTForCausalLM, the LM head tied)."""
    linear = hidden * hidden + hidden  # q, k, v and out_proj, each with a bias
    layer = 4 * linear + (hidden * ffn + ffn) + (ffn * hidden + hidden) + 2 * 2 * hidden  # fc1, fc2, 2 LayerNorms
    return vocab * hidden + (positions + 2) * hidden + layers * layer + 2 * hidden  # + the final LayerNorm


def test_opt_and_llama_3_70b_parameter_totals() -> None:
    assert _opt_total(5120, 40, 20480) == 12_853_473_280  # facebook/opt-13b's checkpoint
    assert _opt_total(9216, 64, 36864) == 65_719_701_504  # facebook/opt-66b's
    assert costs.count_parameters(costs.preset("opt-13b")).total == 12_853_473_280
    assert costs.count_parameters(costs.preset("opt-66b")).total == 65_719_701_504
    counts = costs.count_parameters(costs.preset("opt-13b"))
    assert counts.lm_head == 0 and counts.embedding == (50272 + 2050) * 5120
    assert counts.norms == (2 * 40 + 1) * 2 * 5120
    assert counts.mlp == counts.mlp_active == 40 * (2 * 5120 * 20480 + 20480 + 5120)
    # Llama-3-70B: 80 layers of q/k/v/o (64 query and 8 KV heads of 128) and a SwiGLU of 28672, untied.
    layer = 8192 * 8192 * 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert costs.count_parameters(costs.preset("llama-3-70b")).total == \
        80 * layer + 2 * 128256 * 8192 + 8192 == 70_553_706_496


def test_opt_flops_count_two_matrices_and_no_biases() -> None:
    opt = costs.preset("opt-13b")
    assert costs.matmul_weights_per_token(opt) == 40 * (4 * 5120 * 5120 + 2 * 5120 * 20480)
    assert (opt.num_key_value_heads, opt.head_dim, opt.learned_positions, opt.tie_word_embeddings) == \
        (40, 128, 2050, True)
    # Decode of OPT-66B on 4 A100s over NVLink 3 is memory-bound and reads a quarter of 131 GB per step.
    model = RooflineStepTime(costs.preset("opt-66b"), costs.A100_80GB, tp=4)
    assert model.bound(work_of([], [512] * 8)) == "memory"
    assert model.weight_bytes_per_device == 2 * 65_719_701_504 / 4


TINY_OPT = dict(model_type="opt", vocab_size=320, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                num_attention_heads=8, max_position_embeddings=40, word_embed_proj_dim=64)


def test_opt_parameter_counts_match_transformers() -> None:
    from transformers import OPTConfig, OPTForCausalLM

    hf_cfg = OPTConfig(**{k: v for k, v in TINY_OPT.items() if k != "model_type"})
    model = OPTForCausalLM(hf_cfg)
    groups = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0}
    for name, p in model.named_parameters():  # the tied LM head is listed once, as the embedding
        part = ("embedding" if "embed_" in name else "attention" if ".self_attn." in name
                else "mlp" if ".fc" in name else "norms")
        assert part != "norms" or "layer_norm" in name, name
        groups[part] += p.numel()
    counts = costs.count_parameters(ModelConfig.from_dict(hf_cfg.to_dict(), cost_only=True))
    assert {k: getattr(counts, k) for k in groups} == groups
    assert counts.total == sum(p.numel() for p in model.parameters())


def test_opt_is_costed_not_built() -> None:
    from minipd.models.decoder import DecoderModel

    with pytest.raises(ValueError, match=r"model_type 'opt' is not supported.*cost_only=True"):
        ModelConfig.from_dict(TINY_OPT)
    config = ModelConfig.from_dict(TINY_OPT, cost_only=True)
    assert config.cost_only and not config.gated_mlp and config.norm_bias and config.hidden_act == "relu"
    with pytest.raises(ValueError, match="can cost a 'opt' model"):
        DecoderModel(config)
    # cost_only changes nothing for the families minipd runs.
    assert ModelConfig.from_dict(costs._PRESET_CONFIGS["llama-3-8b"], cost_only=True) == \
        ModelConfig.from_dict(costs._PRESET_CONFIGS["llama-3-8b"])
    assert not LLAMA.cost_only
    # OPT-350M's projected embedding and post-LayerNorm would be miscounted: refused.
    with pytest.raises(ValueError, match="word_embed_proj_dim"):
        ModelConfig.from_dict({**TINY_OPT, "word_embed_proj_dim": 32}, cost_only=True)
    with pytest.raises(ValueError, match="post-LayerNorm"):
        ModelConfig.from_dict({**TINY_OPT, "do_layer_norm_before": False}, cost_only=True)
    with pytest.raises(ValueError, match="'intermediate_size' must be a positive integer"):
        ModelConfig.from_dict({k: v for k, v in TINY_OPT.items() if k != "ffn_dim"}, cost_only=True)


# --- (f) speed -------------------------------------------------------------------------------------


def test_step_time_is_a_few_microseconds() -> None:
    models = [RooflineStepTime(LLAMA, costs.H100_SXM, tp=2), RooflineStepTime(costs.preset("qwen3-30b-a3b"),
                                                                               costs.H200)]
    work = work_of([(1000, 512)], [700] * 64)
    for model in models:
        start = time.perf_counter()
        for _ in range(10_000):
            model.step_time(work)
        assert time.perf_counter() - start < 0.5  # ~1 µs a call; step_cost takes ~0.5 ms
