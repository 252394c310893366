"""Expert capacity at inference time: loads bounded, the right assignments dropped or rerouted, the
layer's output equal to running exactly the kept assignments, and the engine's load evened out."""

from __future__ import annotations

import math

import pytest
import torch

from minipd.layers.moe import MoE
from minipd.moe.capacity import capacity, enforce_capacity


def routed(tokens: int = 40, experts: int = 8, top_k: int = 2, seed: int = 0, skew: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += skew  # a hot expert
    probs = logits.softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return probs, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("policy", ["drop", "reroute"])
@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_no_expert_goes_over_capacity_and_the_strongest_claims_stay(policy, factor):
    probs, weights, ids = routed()
    limit = capacity(40, 2, 8, factor)
    new_w, new_ids = enforce_capacity(probs, weights, ids, factor, policy)
    kept = new_ids[new_ids >= 0]
    assert int(torch.bincount(kept, minlength=8).max()) <= limit
    # Expert 0 was over capacity: it kept exactly its `limit` highest-weighted claims.
    claims = weights[ids == 0]
    assert (ids == 0).sum() > limit
    kept_zero = (new_ids == 0) & (ids == 0)
    assert int(kept_zero.sum()) == limit
    assert torch.equal(weights[kept_zero].sort().values, claims.sort().values[-limit:])
    untouched = (new_ids == ids).all(dim=-1)
    assert torch.equal(new_w[untouched], weights[untouched])  # tokens not over capacity are left alone
    if policy == "drop":
        assert bool((new_w[new_ids < 0] == 0).all()) and (new_ids < 0).any()
    else:
        assert (new_ids >= 0).all()  # every slot found room somewhere (there is room for all)
        for t in range(40):
            assert len(set(new_ids[t].tolist())) == 2  # never the same expert twice
        moved = ~untouched
        expected = probs.gather(1, new_ids)[moved]
        torch.testing.assert_close(new_w[moved], expected / expected.sum(-1, keepdim=True))


def test_a_rerouted_slot_goes_to_the_next_best_expert_with_room():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.6, 0.1, 0.1, 0.2], [0.7, 0.0, 0.1, 0.2]])
    weights, ids = probs.topk(1, dim=-1)
    # Capacity 1 per expert (factor 4/3 of an even share of 3/4): expert 0 keeps token 2's claim (0.7).
    new_w, new_ids = enforce_capacity(probs, weights, ids, 4 / 3, "reroute", renormalize=False)
    assert new_ids[:, 0].tolist() == [1, 3, 0]  # token 1 (0.6) rerouted first: 3 (0.2); token 0: 1 (0.3)
    torch.testing.assert_close(new_w[:, 0], torch.tensor([0.3, 0.2, 0.7]))


@pytest.mark.parametrize("policy", ["drop", "reroute"])
def test_the_capped_layer_equals_running_exactly_the_kept_assignments(policy):
    torch.manual_seed(0)
    layer = MoE(32, 48, 8, 2).eval()
    with torch.no_grad():
        layer.router.weight[0] += 0.5  # skew the router toward expert 0
        x = torch.randn(30, 32)
        layer.capacity_factor, layer.overflow = 1.0, policy
        got = layer(x)
        weights, ids = layer.router(x)
        weights, ids = enforce_capacity(layer.router.probabilities(x), weights, ids, 1.0, policy)
        want = torch.zeros_like(x)
        for t in range(30):
            for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
                if e >= 0:
                    gate, up = torch.nn.functional.linear(x[t], layer.experts.gate_up_proj[e]).split(48)
                    want[t] += w * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                                              layer.experts.down_proj[e])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_capacity_evens_out_the_engines_load_and_bad_options_are_named():
    from minipd import LLM, SamplingParams

    prompt = "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser()\n" * 3
    params = SamplingParams(temperature=0, max_tokens=1)
    loads = {}
    for name, options in {"free": {}, "drop": {"moe_capacity_factor": 1.0},
                          "reroute": {"moe_capacity_factor": 1.0, "moe_overflow": "reroute"}}.items():
        llm = LLM("tiny-py-moe", record_routing=True, enable_prefix_caching=False, **options)
        llm.generate([prompt], params)
        counts = llm.engine.core.step_stats[0].expert_counts  # the prefill step
        tokens = llm.engine.core.step_stats[0].num_tokens
        assert tokens == 54
        loads[name] = (max(max(c) for c in counts), sum(map(sum, counts)), tokens * len(counts))
    free, drop, reroute = loads["free"], loads["drop"], loads["reroute"]
    limit = math.ceil(54 * 2 / 8)  # 54 prompt tokens, top-2 of 8 experts, factor 1
    assert free[0] > limit >= drop[0] and reroute[0] <= limit  # the hottest expert is capped
    assert drop[1] < free[1] == reroute[1] == free[2] * 2  # dropped slots go; rerouted ones all land
    with pytest.raises(ValueError, match="moe_overflow must be one of 'drop', 'reroute'"):
        LLM("tiny-py-moe", moe_capacity_factor=1.0, moe_overflow="resample")
    with pytest.raises(ValueError, match="moe_capacity_factor must be None or a positive number"):
        LLM("tiny-py-moe", moe_capacity_factor=0)


def test_load_reports_read_imbalance_both_ways():
    from minipd.evaluation.moe_balance import LoadReport

    report = LoadReport(torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0]]))
    assert report.max_over_mean == [1.0, 4.0]
    assert report.coefficient_of_variation[0] == 0.0
    assert report.coefficient_of_variation[1] == pytest.approx(3 ** 0.5)


def test_moebalance_measures_the_bundled_model_and_prices_capacity():
    import os
    import subprocess
    import sys

    from minipd.evaluation.moe_balance import measure_load

    load = measure_load("tiny-py-moe", num_windows=1)
    assert load.counts.shape == (4, 8) and bool((load.counts.sum(dim=1) == 256 * 2).all())
    assert all(ratio > 1.5 for ratio in load.max_over_mean)  # the bundled model is far from even
    capped = measure_load("tiny-py-moe", num_windows=1, moe_capacity_factor=1.0, moe_overflow="reroute")
    # Even to the token: capacity is exactly the mean, and a slot whose only room is at an expert its token
    # already has is dropped.
    assert all(ratio < 1.01 for ratio in capped.max_over_mean)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "minipd", "moebalance", "--windows", "1"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "layer 3: hottest expert" in out.stdout and "cap 1.0 reroute" in out.stdout
    assert "cap 2.0 drop" in out.stdout and "auto" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "minipd", "moebalance", "--windows", "0"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--windows must be at least 1" in bad.stderr


def test_quantized_gates_keep_most_top_k_sets_and_dispatch_bytes_shrink():
    from minipd import LLM, SamplingParams
    from minipd.evaluation.moe_balance import dispatch_bytes_per_token, routing_agreement

    int8, int4 = (routing_agreement("tiny-py-moe", fmt, num_windows=1) for fmt in ("int8", "int4"))
    assert routing_agreement("tiny-py-moe", None, num_windows=1) == 1.0
    assert 1.0 >= int8 > 0.98 and int8 > int4 > 0.85
    assert dispatch_bytes_per_token("tiny-py-moe") == 2 * 256 * 4  # top-2 copies of a 256-wide fp32 row
    assert dispatch_bytes_per_token("tiny-py-moe", "fp8") == 2 * (256 + 2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM("tiny-py-moe").generate(["def main():"], params)[0].token_ids
    rounded = LLM("tiny-py-moe", router_dtype="int8", moe_dispatch_dtype="int8").generate(["def main():"], params)
    assert rounded[0].token_ids[:4] == plain[:4]
    with pytest.raises(ValueError, match="router_dtype must be one of 'auto', 'int8', 'int4', got 'int2'"):
        LLM("tiny-py-moe", router_dtype="int2")
    with pytest.raises(ValueError, match="moe_dispatch_dtype must be one of 'auto', 'int8', 'fp8'"):
        LLM("tiny-py-moe", moe_dispatch_dtype="int4")


def test_a_quantized_gate_routes_with_the_round_trip_of_its_rows():
    from minipd.kv.quant import fake_quantize
    from minipd.moe.router import SoftmaxRouter

    torch.manual_seed(0)
    router = SoftmaxRouter(32, 8, 2)
    x = torch.randn(16, 32)
    router.weight_format = "int4"
    got = router(x)
    rounded = SoftmaxRouter(32, 8, 2)
    rounded.weight.data = fake_quantize(router.weight.data, "int4_per_token")
    want = rounded(x)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert not torch.equal(router.gate_weight(), router.weight)  # the stored weight itself is untouched
