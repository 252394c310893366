"""The mixture-of-experts layer piece by piece (router, dispatcher, stacked experts) and whole.

Routers and layers are checked against HF transformers' Mixtral, Qwen2-MoE and DeepSeek-V3 modules
with the same weights; every experts path that runs on CPU is checked against the others and against
per-expert :class:`SwiGLU` modules; the weight loader against both HF checkpoint layouts.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model
from safetensors.torch import save_file

from minipd.layers.mlp import SwiGLU
from minipd.layers.moe import MoE
from minipd.models import load_model
from minipd.moe import (
    LocalDispatcher,
    SigmoidGroupedRouter,
    SoftmaxRouter,
    StackedExperts,
    grouped_mm_supported,
)

HIDDEN, INTER, EXPERTS, TOP_K = 32, 48, 8, 2

CPU_GROUPED = grouped_mm_supported(torch.device("cpu"), torch.float32, HIDDEN, INTER)
#: Every experts path this machine can run on CPU; "auto" resolves to one of them.
CPU_PATHS = ["loop", "grouped_mm"] if CPU_GROUPED else ["loop"]


def _hidden(tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) with each row sorted by expert id, to compare choices whatever their order."""
    ids, perm = ids.sort(dim=-1)
    return weights.gather(1, perm), ids


# --- routers --------------------------------------------------------------------------------------


def test_softmax_router_matches_hf_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    torch.manual_seed(0)
    hf = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K))
    torch.nn.init.normal_(hf.weight)
    ours = SoftmaxRouter(HIDDEN, EXPERTS, TOP_K)
    ours.weight.data.copy_(hf.weight.data)
    x = _hidden(64)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
        weights, ids = ours(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))


def test_softmax_router_without_renormalisation_matches_hf_qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    hf = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                           norm_topk_prob=False))
    torch.nn.init.normal_(hf.weight, std=0.2)
    ours = SoftmaxRouter(HIDDEN, EXPERTS, TOP_K, renormalize=False)
    ours.weight.data.copy_(hf.weight.data)
    x = _hidden(64)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
        weights, ids = ours(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    assert (weights.sum(-1) < 1 - 1e-4).all()  # a share of the full softmax, not renormalised


def _hf_deepseek_router(n_group: int, topk_group: int, top_k: int, normalize: bool, seed: int = 0):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=top_k, n_group=n_group,
                              topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=normalize,
                              moe_intermediate_size=INTER)
    torch.manual_seed(seed)
    hf = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(hf.weight, std=0.3)
    # A bias as large as the score spread, so it really changes which experts win.
    hf.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    ours = SigmoidGroupedRouter(HIDDEN, 16, top_k, n_group, topk_group, routed_scaling_factor=2.5, normalize=normalize)
    ours.weight.data.copy_(hf.weight.data)
    ours.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    return hf, ours


@pytest.mark.parametrize(("n_group", "topk_group", "top_k", "normalize"),
                         [(4, 2, 4, True), (4, 1, 3, True), (8, 3, 5, False), (1, 1, 4, True)])
def test_sigmoid_grouped_router_matches_hf_deepseek_v3(n_group, topk_group, top_k, normalize):
    hf, ours = _hf_deepseek_router(n_group, topk_group, top_k, normalize)
    x = _hidden(128, seed=1)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
        weights, ids = ours(x)
    # HF's top-k is unsorted, so compare each token's set of experts and their weights by expert id.
    hf_weights, hf_ids = _by_id(hf_weights, hf_ids)
    weights, ids = _by_id(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    # Each token's experts come from at most topk_group groups.
    groups = ids // (16 // n_group)
    assert max(len(set(row)) for row in groups.tolist()) <= topk_group
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.full((128,), 2.5))


def test_sigmoid_router_bias_steers_choice_but_not_weights():
    _, ours = _hf_deepseek_router(4, 2, 4, True)
    x = _hidden(128, seed=2)
    with torch.no_grad():
        _, biased_ids = ours(x)
        ours.e_score_correction_bias.zero_()
        _, plain_ids = ours(x)
        scores = torch.sigmoid(x @ ours.weight.T)
    assert not torch.equal(biased_ids.sort(-1).values, plain_ids.sort(-1).values)
    # The weights are the unbiased sigmoid scores of the chosen experts, normalised and scaled.
    with torch.no_grad():
        ours.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
        weights, ids = ours(x)
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_router_arguments_are_checked():
    with pytest.raises(ValueError, match="top_k"):
        SoftmaxRouter(HIDDEN, 4, 5)
    with pytest.raises(ValueError, match="n_group"):
        SigmoidGroupedRouter(HIDDEN, 10, 2, n_group=4)
    with pytest.raises(ValueError, match="kept groups"):
        SigmoidGroupedRouter(HIDDEN, 16, 5, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="scoring"):
        MoE(HIDDEN, INTER, EXPERTS, TOP_K, scoring="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sigmoid"):
        MoE(HIDDEN, INTER, EXPERTS, TOP_K, n_group=2)


# --- dispatcher -----------------------------------------------------------------------------------


def test_local_dispatch_groups_rows_by_expert_and_combine_inverts_it():
    tokens, k = 10, 3
    gen = torch.Generator().manual_seed(0)
    x = _hidden(tokens)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    dispatcher = LocalDispatcher(EXPERTS)
    batch = dispatcher.dispatch(x, weights, ids)
    assert batch.counts.tolist() == torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    # Row r belongs to expert expert_of_row[r]: non-decreasing, so each expert's rows are one block,
    # and every row is the hidden state of a token that chose that expert.
    expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS), batch.counts)
    assert (expert_of_row.diff() >= 0).all()
    for row, e in zip(batch.hidden, expert_of_row.tolist(), strict=True):
        token = int((x == row).all(-1).nonzero()[0])
        assert e in ids[token].tolist()
    # Experts that add their id: combine must give sum_k w_k * (x + e_k) per token.
    out = dispatcher.combine(batch.hidden + expert_of_row[:, None].float(), batch)
    expected = (weights[..., None] * (x[:, None, :] + ids[..., None].float())).sum(1)
    torch.testing.assert_close(out, expected)


# --- experts --------------------------------------------------------------------------------------


def _experts(implementation: str, dtype: torch.dtype = torch.float32) -> StackedExperts:
    torch.manual_seed(0)
    return StackedExperts(EXPERTS, HIDDEN, INTER, implementation).to(dtype)  # type: ignore[arg-type]


def _grouped_rows(counts: list[int], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return _hidden(sum(counts), seed=3, dtype=dtype), torch.tensor(counts)


@pytest.mark.parametrize("implementation", CPU_PATHS)
def test_stacked_experts_equal_per_expert_swiglu(implementation):
    """Expert e of the stack is a SwiGLU whose fused gate_up weight is gate_up_proj[e] (gate rows first)."""
    experts = _experts(implementation)
    counts = [3, 0, 5, 1, 0, 2, 4, 1]  # with experts that got no rows
    rows, counts_t = _grouped_rows(counts)
    with torch.no_grad():
        got = experts(rows, counts_t)
        expected = []
        for e, block in enumerate(rows.split(counts)):
            mlp = SwiGLU(HIDDEN, INTER)
            mlp.gate_up_proj.weight.copy_(experts.gate_up_proj[e])
            mlp.down_proj.weight.copy_(experts.down_proj[e])
            expected.append(mlp(block))
    torch.testing.assert_close(got, torch.cat(expected))


@pytest.mark.skipif(not CPU_GROUPED, reason="this torch has no CPU kernel for torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_equals_loop_path(dtype):
    loop, grouped = _experts("loop", dtype), _experts("grouped_mm", dtype)
    assert torch.equal(loop.gate_up_proj, grouped.gate_up_proj)
    for counts in ([3, 0, 5, 1, 0, 2, 4, 1], [0, 0, 0, 1, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0, 0, 9]):
        rows, counts_t = _grouped_rows(counts, dtype)
        with torch.no_grad():
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(grouped(rows, counts_t), loop(rows, counts_t), **tol)


def test_auto_runs_the_loop_on_cpu():
    """On CPU the per-layer host transfer is free, and flop counters see the loop's matmuls."""
    experts = _experts("auto")
    assert not experts.uses_grouped_mm(_hidden(4))
    assert _experts("grouped_mm").uses_grouped_mm(_hidden(4))
    with pytest.raises(ValueError, match="moe_backend must be one of 'auto', 'loop', 'grouped_mm', 'triton'"):
        StackedExperts(EXPERTS, HIDDEN, INTER, "cutlass")  # type: ignore[arg-type]


@pytest.mark.parametrize("implementation", CPU_PATHS)
def test_host_transfers_per_layer(implementation, monkeypatch):
    """The loop path reads the counts on the host once per layer; the grouped path never does."""
    calls = []
    for method in ("tolist", "item"):
        original = getattr(torch.Tensor, method)

        def spy(self, *args, _original=original, _method=method, **kwargs):
            calls.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, spy)
    moe = MoE(HIDDEN, INTER, EXPERTS, TOP_K, implementation=implementation)
    with torch.no_grad():
        moe(_hidden(16))
    assert calls == (["tolist"] if implementation == "loop" else [])


# --- the whole layer ------------------------------------------------------------------------------


def _hf_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


@pytest.mark.parametrize("implementation", ["auto", *CPU_PATHS])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_matches_hf_mixtral_block(implementation, tokens):
    hf = _hf_mixtral_block()
    ours = MoE(HIDDEN, INTER, EXPERTS, TOP_K, implementation=implementation)
    ours.router.weight.data.copy_(hf.gate.weight.data)
    ours.experts.gate_up_proj.data.copy_(hf.experts.gate_up_proj.data)
    ours.experts.down_proj.data.copy_(hf.experts.down_proj.data)
    x = _hidden(tokens, seed=tokens)
    with torch.no_grad():
        expected = hf(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert ours(x[None]).shape == (1, tokens, HIDDEN)  # leading dims are kept


@pytest.mark.parametrize("implementation", CPU_PATHS)
def test_moe_of_no_tokens_is_empty(implementation):
    moe = MoE(HIDDEN, INTER, EXPERTS, TOP_K, implementation=implementation)
    with torch.no_grad():
        assert moe(_hidden(0)).shape == (0, HIDDEN)


@pytest.mark.parametrize("implementation", CPU_PATHS)
def test_sigmoid_moe_matches_hf_deepseek_v3_routed_experts(implementation):
    """DeepSeek-V3's routed part (its gate and experts; the shared expert is not part of this layer)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                              topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                              moe_intermediate_size=INTER)
    torch.manual_seed(0)
    hf = DeepseekV3MoE(config).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    hf.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    ours = MoE(HIDDEN, INTER, 16, 4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
               implementation=implementation)
    ours.router.weight.data.copy_(hf.gate.weight.data)
    ours.router.e_score_correction_bias.data.copy_(hf.gate.e_score_correction_bias)
    ours.experts.gate_up_proj.data.copy_(hf.experts.gate_up_proj.data)
    ours.experts.down_proj.data.copy_(hf.experts.down_proj.data)
    x = _hidden(40, seed=4)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        expected = hf.experts(x, hf_ids, hf_weights)
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moe_makes_no_host_sync():
    device = torch.device("cuda")
    moe = MoE(4 * HIDDEN, 4 * INTER, EXPERTS, TOP_K).to(device, torch.bfloat16)
    if not moe.experts.uses_grouped_mm(torch.empty(1, 4 * HIDDEN, device=device, dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm has no native kernel for bf16 on this GPU")
    x = torch.randn(300, 4 * HIDDEN, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)  # warm-up: first calls may sync while loading kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        moe.experts.implementation = "loop"
        expected = moe(x)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


# --- loading both HF checkpoint layouts -----------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    hf = make_hf_model(folder, "mixtral")  # save_pretrained writes per-expert block_sparse_moe.experts.{e}.w1/w2/w3
    return hf, folder


def _assert_stacked_weights_equal_hf(model, hf) -> None:
    hf_state = hf.state_dict()  # transformers 5 holds the experts fused: (E, 2I, H) and (E, H, I)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}.mlp."
        assert torch.equal(layer.mlp.experts.gate_up_proj, hf_state[prefix + "experts.gate_up_proj"])
        assert torch.equal(layer.mlp.experts.down_proj, hf_state[prefix + "experts.down_proj"])
        assert torch.equal(layer.mlp.router.weight, hf_state[prefix + "gate.weight"])


def test_loads_per_expert_checkpoint_into_stacked_weights(mixtral_checkpoint):
    from safetensors import safe_open

    hf, folder = mixtral_checkpoint
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any(".mlp.experts." in name for name in names)
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    _assert_stacked_weights_equal_hf(model, hf)


def test_loads_fused_checkpoint_into_stacked_weights(mixtral_checkpoint, tmp_path):
    hf, folder = mixtral_checkpoint
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    # The transformers-5 in-memory names, written as is: mlp.gate, mlp.experts.gate_up_proj / down_proj.
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path, device="cpu", dtype=torch.float32)
    _assert_stacked_weights_equal_hf(model, hf)


def test_missing_expert_tensor_is_reported(mixtral_checkpoint, tmp_path):
    from safetensors import safe_open

    _, folder = mixtral_checkpoint
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        # Drop one expert's up rows: its gate_up_proj slice is then only half filled.
        state = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(tmp_path, device="cpu", dtype=torch.float32)


def test_routing_is_recorded_per_step_and_layer_when_asked():
    """tokens per expert sum to tokens x top_k in every MoE layer of every step, match the router run on
    the layer's own input, and the entropy lies between 0 and log(top_k)."""
    import math

    from minipd import LLM, SamplingParams

    llm = LLM("tiny-py-moe", record_routing=True, enable_prefix_caching=False)
    core = llm.engine.core
    layer0 = core.moe_layers[0]
    seen: list[torch.Tensor] = []
    width = llm.config.hidden_size
    handle = layer0.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().reshape(-1, width)))
    llm.generate(["def main(argv):\n    return 0\n"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    handle.remove()
    stats = list(core.step_stats)
    k, experts = layer0.top_k, layer0.router.num_experts
    assert len(stats) == 6 and all(len(s.expert_counts) == len(core.moe_layers) for s in stats)
    for s in stats:
        tokens = s.num_tokens
        assert all(sum(c) == tokens * k and len(c) == experts for c in s.expert_counts)
        assert all(0 <= e <= math.log(k) + 1e-6 for e in s.router_entropy)
    for step, hidden in zip(stats, seen, strict=True):
        _, ids = layer0.router(hidden)
        assert tuple(torch.bincount(ids.reshape(-1), minlength=experts).tolist()) == step.expert_counts[0]
    plain = LLM("tiny-py-moe")
    plain.generate(["x = 1"], SamplingParams(max_tokens=2))
    assert plain.engine.core.step_stats[-1].expert_counts == ()

