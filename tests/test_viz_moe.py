"""Chapter 07's figures and their numbers: real MoE model sizes, experts touched, token kinds, capacity on
recorded routing, every plot drawing, and the routing explorer redrawing on each change."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch

from minipd.config import ModelConfig
from minipd.moe.placement import contiguous_placement, imbalance
from minipd.sim.costs import MODEL_PRESETS
from minipd.viz import moe as viz


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def logits(tokens: int = 200, experts: int = 8, seed: int = 0) -> torch.Tensor:
    """Router logits with a hot expert 0, as trained routers have."""
    out = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    out[:, 0] += 1.5
    return out


# --- numbers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "total", "active"), [
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # the model card: 46.7B total, 12.9B active
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # the model card: 30.5B total, 3.3B activated
    ("deepseek-v3", 671e9, 37e9),  # the technical report: 671B total, 37B activated (MTP module excluded)
])
def test_real_models_match_their_published_sizes(name: str, total: float, active: float) -> None:
    m = viz.moe_model(name)
    assert m.total_params == pytest.approx(total, rel=0.01)
    assert m.active_params == pytest.approx(active, rel=0.03)
    assert m.flops_per_token < m.dense_flops_per_token
    assert m.always_read_params < m.active_params < m.total_params


def test_the_fallback_counts_agree_with_the_costs_presets() -> None:
    qwen = viz._from_model_config("q", ModelConfig.from_dict(viz.QWEN3_30B_A3B_CONFIG), "")
    deepseek = viz._deepseek_v3()
    assert deepseek.moe_layers == 58 and deepseek.num_experts == 256 and deepseek.top_k == 8
    if "qwen3-30b-a3b" in MODEL_PRESETS:
        assert qwen.total_params == viz.moe_model("qwen3-30b-a3b").total_params
    if "deepseek-v3" in MODEL_PRESETS:
        preset = viz.moe_model("deepseek-v3")
        # The fallback also counts the 58 x 256 selection biases, which are not weights.
        assert deepseek.total_params == pytest.approx(preset.total_params, rel=1e-6)
        assert deepseek.active_params == pytest.approx(preset.active_params, rel=1e-6)
    with pytest.raises(ValueError, match="unknown MoE model"):
        viz.moe_model("llama-3-8b")


def test_decode_reads_more_weights_as_the_batch_grows_up_to_all_of_them() -> None:
    m = viz.moe_model("mixtral-8x7b")
    bytes_read = [m.decode_weight_bytes(b) for b in (1, 2, 8, 64, 4096)]
    assert bytes_read == sorted(bytes_read)
    # One token reads its 2 experts per layer: every weight it multiplies by (LM head included), in bf16.
    assert bytes_read[0] == pytest.approx(2 * m.weights_per_token, rel=1e-3)
    assert bytes_read[-1] == pytest.approx(2 * (m.always_read_params + m.moe_layers * 8 * m.expert_params))


def test_expected_experts_touched() -> None:
    assert viz.expected_experts_touched(8, 2, 0) == 0
    assert viz.expected_experts_touched(8, 2, 1) == pytest.approx(2)
    assert viz.expected_experts_touched(8, 8, 5) == pytest.approx(8)
    assert viz.expected_experts_touched(256, 8, 10_000) == pytest.approx(256)
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(3000, 4, 64, generator=gen).topk(8, dim=-1).indices.reshape(3000, -1)
    simulated = torch.zeros(3000, 64).scatter_(1, ids, 1.0).sum(1).mean().item()
    assert viz.expected_experts_touched(64, 8, 4) == pytest.approx(simulated, abs=0.1)


@pytest.mark.parametrize(("text", "kind"), [
    ("def ", "keyword"), ("    return ", "keyword"), ("self", "keyword"), ("None", "keyword"),
    ("factor", "name"), ("_x1", "name"), ("42", "number"), ("3.14", "number"), ("1_000", "number"),
    ("\n", "whitespace"), ("        ", "whitespace"), ("(x", "punctuation"), ("):\n", "punctuation"),
    ("self.", "punctuation"), ('"', "punctuation"),
])
def test_token_class(text: str, kind: str) -> None:
    assert viz.token_class(text) == kind
    assert kind in viz.TOKEN_CLASSES


def test_capacity_load_drops_and_reroutes_what_the_cap_says() -> None:
    lg = logits()
    free = viz.capacity_load(lg, 2, None)
    assert torch.equal(free.kept, free.unconstrained) and free.dropped == free.rerouted == 0
    assert int(free.kept.sum()) == 400
    dropped = viz.capacity_load(lg, 2, 1.0, "drop")
    assert dropped.capacity == 50 and int(dropped.kept.max()) <= 50
    assert dropped.dropped > 0 and dropped.rerouted == 0
    assert int(dropped.kept.sum()) == pytest.approx(400 * (1 - dropped.dropped))
    rerouted = viz.capacity_load(lg, 2, 1.0, "reroute")
    assert rerouted.rerouted > 0 and rerouted.dropped < dropped.dropped
    # A factor of 1.0 with rerouting: every expert full, but for a slot whose only free expert the token had already.
    assert int(rerouted.kept.max()) == 50 and int(rerouted.kept.min()) >= 49
    assert int(rerouted.kept.sum()) == pytest.approx(400 * (1 - rerouted.dropped))
    # A generous cap changes nothing.
    assert viz.capacity_load(lg, 2, 8.0).dropped == 0


# --- plots -----------------------------------------------------------------------------------------


def test_the_map_and_the_sparsity_plot() -> None:
    ax = viz.plot_moe_map()
    assert any("MoE layer" in t.get_text() for t in ax.texts)
    models = [viz.moe_model(n) for n in viz.MOE_MODELS]
    axes = viz.plot_sparsity(models)
    assert [t.get_text() for t in axes[0].get_xticklabels()] == list(viz.MOE_MODELS)
    assert len(axes[0].patches) == 6 and axes[0].get_yscale() == "log"


def test_routing_plots() -> None:
    lg = logits(12)
    ax = viz.plot_router_heatmap(lg.softmax(-1), [f"t{i}" for i in range(12)], top_k=2, title="x")
    assert len(ax.collections) == 12  # one ring pair per token
    shares = torch.rand(3, len(viz.TOKEN_CLASSES), 8)
    axes = viz.plot_class_shares(shares, viz.TOKEN_CLASSES, [1, 2, 3, 4, 5])
    assert len(axes) == 3 and axes[0].get_yticklabels()[0].get_text() == "keyword (1)"


def test_load_and_balance_plots() -> None:
    counts = torch.tensor([[10, 20, 30, 40], [25, 25, 25, 25]])
    axes = viz.plot_expert_load(counts)
    assert "max/mean 1.60" in axes[0].get_title() and "max/mean 1.00" in axes[1].get_title()
    axes = viz.plot_capacity_tradeoff([("auto", 2.5, 0.0, 0.0), ("cap 1.0 drop", 1.4, 0.8, 1.0),
                                       ("cap 1.0 reroute", 1.0, 0.9, 1.2)])
    assert len(axes[0].collections) == 3
    loads = [500.0, 100, 80, 70, 60, 50, 40, 30]
    axes = viz.plot_placement(loads, num_devices=4, redundant=4)
    assert f"max/mean {imbalance(contiguous_placement(8, 4), loads):.2f}" in axes[0].get_title()
    heights = [sum(p.get_height() for p in ax.patches) for ax in axes]
    assert heights == pytest.approx([sum(loads)] * 3)  # every placement carries all the tokens


def test_kernel_quantized_and_decode_plots() -> None:
    times = {"layer A": {4: {"loop": [0.002, 0.003], "grouped_mm": [0.001, 0.002]},
                         256: {"loop": [0.01], "grouped_mm": [0.02]}}}
    axes = viz.plot_kernel_ladder(times)
    assert len(axes[0].patches) == 4
    assert axes[0].patches[0].get_height() == pytest.approx(4 / 0.002)
    rows = [viz.QuantizedRouting("auto", 1.0, 0.0, 0.0, 1.0, 2048),
            viz.QuantizedRouting("gate int4", 0.96, 3e-3, 0.007, 0.6, 2048),
            viz.QuantizedRouting("dispatch fp8", 1.0, 3e-4, 0.001, 0.9, 516)]
    axes = viz.plot_quantized_routing(rows)
    assert [p.get_width() for p in axes[2].patches] == [2048, 2048, 516]
    models = [viz.moe_model(n) for n in viz.MOE_MODELS]
    axes = viz.plot_experts_touched(models, [1, 4, 16, 64], measured={1: [2, 2], 4: [4, 5]})
    assert len(axes[0].lines) == 3 and len(axes[0].collections) == 1


def test_capacity_figures_and_the_explorer() -> None:
    lg = logits()
    ax = viz.plot_capacity_load(lg, 2, 1.0, "drop")
    assert "dropped" in ax.get_title()
    axes = viz.plot_capacity_sweep(lg, factors=(1.0, 2.0), top_ks=(1, 2))
    assert len(axes[0].lines) == 2
    explorer = viz.routing_explorer(lg, title="test")
    top_k, factor, policy = explorer.children[0].children
    first = explorer.shown[0]
    assert first.dropped > 0
    factor.value = 4.0
    assert explorer.shown[0].dropped < first.dropped
    policy.value = "reroute"
    top_k.value = 1
    assert explorer.shown[0].kept.sum() <= 200
    assert "live kernel" in repr(explorer)
