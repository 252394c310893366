"""The Triton fused-MoE kernel against its torch reference (under the interpreter on CPU) and against the
MoE layer's own paths; the block alignment's invariants."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read as each kernel is defined, so before the imports below

import pytest

from minipd.kernels.fused_moe import BLOCK_M, align_to_blocks, fused_moe_torch, fused_moe_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0,
         dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    to = {"device": DEVICE}
    return (x.to(dtype=dtype, **to), weights.to(**to), ids.to(**to), gate_up.to(dtype=dtype, **to),
            down.to(dtype=dtype, **to))


def test_alignment_pads_each_expert_to_whole_tiles_and_keeps_every_pair_once():
    ids = torch.tensor([[0, 3], [3, 1], [0, 3], [3, 0], [5, 3]])
    pairs, block_experts = align_to_blocks(ids, 6, block_m=4)
    sentinel = ids.numel()
    assert pairs.numel() == block_experts.numel() * 4
    real = pairs[pairs < sentinel]
    assert sorted(real.tolist()) == list(range(ids.numel()))  # every pair exactly once
    flat = ids.reshape(-1)
    for tile, expert in enumerate(block_experts.tolist()):
        chunk = pairs[tile * 4:(tile + 1) * 4]
        assert all(flat[p] == expert for p in chunk[chunk < sentinel].tolist())
    # Expert 3 has 5 pairs: two tiles; experts 0, 1 and 5 one each; 2 and 4 none.
    assert block_experts.tolist() == [0, 1, 3, 3, 5]


@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"),
                         [(1, 32, 48, 8, 2), (37, 32, 48, 8, 2), (20, 64, 40, 6, 3), (5, 32, 32, 16, 1)])
def test_fused_kernel_matches_the_reference(tokens, hidden, inter, experts, top_k):
    x, w, ids, gate_up, down = case(tokens, hidden, inter, experts, top_k)
    got = fused_moe_triton(x, w, ids, gate_up, down)
    want = fused_moe_torch(x, w, ids, gate_up, down)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_fused_kernel_in_fp16_is_close_and_empty_input_is_empty():
    x, w, ids, gate_up, down = case(24, 32, 48, 8, 2, dtype=torch.float16)
    got = fused_moe_triton(x, w, ids, gate_up, down)
    want = fused_moe_torch(x.float(), w, ids, gate_up.float(), down.float())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)
    empty = fused_moe_triton(x[:0], w[:0], ids[:0], gate_up, down)
    assert empty.shape == (0, 32)


def test_the_moe_layer_gives_the_same_output_on_every_path():
    from minipd.layers.moe import MoE

    torch.manual_seed(0)
    layer = MoE(32, 48, 8, 2).to(DEVICE)
    x = torch.randn(29, 32, device=DEVICE)
    with torch.no_grad():
        outputs = {}
        for implementation in ("loop", "triton"):
            layer.experts.implementation = implementation
            outputs[implementation] = layer(x)
    torch.testing.assert_close(outputs["triton"], outputs["loop"], atol=2e-5, rtol=1e-4)
    assert BLOCK_M == 16


def test_the_engine_gives_the_same_tokens_on_every_moe_backend():
    """tiny-py-moe end to end: greedy tokens equal on the loop, grouped and fused paths."""
    from minipd import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # (the interpreter is slow)
    prompts = ["def main(argv):\n    ", "import os"]
    tokens = {}
    for backend in ("loop", "grouped_mm", "triton"):
        llm = LLM("tiny-py-moe", moe_backend=backend)
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["loop"] == tokens["grouped_mm"]
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        LLM("tiny-py-moe", moe_backend="cutlass")
