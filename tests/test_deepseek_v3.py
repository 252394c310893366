"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, shared experts) against HF transformers.

Tiny random DeepSeek-V3 models are built with transformers, with every norm weight, bias and routing
correction bias randomised (HF initialises them to ones or zeros, which would hide a misplaced one),
saved in HF format and loaded by minipd. They must give the same logits (fp32 tolerance) without a
cache, through a contiguous cache and through the paged pool of latents (chunked prefill, batched
decode, both attention forms), and the same greedy tokens as HF ``generate`` through the engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, hf_config, save_tokenizer

from minipd import LLM, SamplingParams
from minipd.kernels.backend import TORCH_BACKEND
from minipd.kv import ContiguousKVCache, PagedAttentionMetadata, PagedKVCache, PagedKVPool
from minipd.kv.spec import KVSpec
from minipd.layers.mla import MultiHeadLatentAttention
from minipd.layers.moe import MoE
from minipd.models import load_model
from minipd.models.forward_context import ForwardContext
from minipd.moe.router import SigmoidGroupedRouter
from minipd.sim import costs

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
CASES = {
    # Queries straight from the hidden state; 4 expert groups, the best 2 compete; layer 0 dense.
    "q-direct": dict(q_lora_rank=None),
    # A query bottleneck; 2 groups, the best 1 competes; top-k weights not renormalised; no dense layer.
    "q-lora": dict(q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=False, first_k_dense_replace=0),
    # YaRN RoPE with both mscales, the half-split (not interleaved) rope layout, biases, two dense layers.
    "yarn-bias": dict(q_lora_rank=24, attention_bias=True, rope_interleave=False, rope_parameters=YARN,
                      first_k_dense_replace=2),
}


def make_deepseek(folder: Path, seed: int = 0, **overrides):
    """Build, randomise, save (with a tokenizer) and return a tiny HF DeepSeek-V3 in fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config("deepseek_v3", **overrides)).float().eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.5, 0.5)  # sigmoid scores are in (0, 1): this reorders experts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    hf = make_deepseek(folder, **CASES[request.param])
    ours, _ = load_model(folder, device="cpu", dtype=torch.float32)
    return hf, ours, folder, request.param


def prompts(n: int = 3, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (length,), generator=gen).tolist() for length in (5, 20, 47)[:n]]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


# --- the model ----------------------------------------------------------------------------------------


def test_the_config_and_weights_are_read_as_deepseek_v3(models):
    hf, ours, _, case = models
    cfg, raw = ours.config, CASES[case]
    assert cfg.is_mla and cfg.kv_latent_dim == 32 + 8 and cfg.head_dim == 16 + 8 and cfg.rope_dim == 8
    assert cfg.q_lora_rank == raw["q_lora_rank"]
    dense = raw.get("first_k_dense_replace", 1)
    assert [isinstance(layer.mlp, MoE) for layer in ours.layers] == [i >= dense for i in range(3)]
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in ours.layers)
    moe = ours.layers[2].mlp
    router = moe.router
    assert isinstance(router, SigmoidGroupedRouter)
    assert (router.n_group, router.topk_group) == (raw.get("n_group", 4), raw.get("topk_group", 2))
    assert router.routed_scaling_factor == 2.5 and router.normalize == raw.get("norm_topk_prob", True)
    # DeepSeek's shared experts are added ungated, unlike Qwen2-MoE's.
    assert moe.shared_expert is not None and moe.shared_expert_gate is None
    # The selection-only bias is loaded (it is randomised, so a zero would mean it was dropped).
    torch.testing.assert_close(router.e_score_correction_bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)
    assert router.e_score_correction_bias.abs().sum() > 0


def test_logits_match_hf(models):
    hf, ours, _, _ = models
    for ids in prompts():
        with torch.no_grad():
            got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
        torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_contiguous_cache_decode_matches_hf(models, absorb, monkeypatch):
    hf, ours, _, _ = models
    monkeypatch.setattr(MultiHeadLatentAttention, "absorb_decode", absorb)
    cfg = ours.config
    ids = prompts()[2]
    cache = ContiguousKVCache(cfg.num_hidden_layers, len(ids), 1, cfg.kv_latent_dim)
    x = torch.tensor(ids)
    with torch.no_grad():
        steps = [ours.compute_logits(ours(x[:30], torch.arange(30), cache))]
        for t in range(30, len(ids)):
            steps.append(ours.compute_logits(ours(x[t:t + 1], torch.tensor([t]), cache)))
    torch.testing.assert_close(torch.cat(steps), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    assert cache.v.numel() == 0 or cache.v.shape[-1] == cfg.kv_latent_dim  # V is never written for MLA


def step_metadata(entries: list[tuple[list[int], int, int]], block_size: int) -> PagedAttentionMetadata:
    """The metadata of one engine step over ``entries`` of ``(block_table, cached, new)``, decodes (new == 1)
    first, laid out as the model runner lays it out."""
    decodes = [e for e in entries if e[2] == 1]
    prefills = [e for e in entries if e[2] > 1]
    assert entries == decodes + prefills
    slots = [table[c // block_size] * block_size + c % block_size
             for table, cached, new in entries for c in range(cached, cached + new)]
    width = max(len(table) for table, _, _ in entries)

    def tables(group: list[tuple[list[int], int, int]]) -> torch.Tensor:
        rows = [table + [0] * (width - len(table)) for table, _, _ in group]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(group), width)

    starts = [0]
    for _, _, new in prefills:
        starts.append(starts[-1] + new)
    decode_lens = [cached + 1 for _, cached, _ in decodes]
    prefill_lens = [cached + new for _, cached, new in prefills]
    return PagedAttentionMetadata(
        num_decode_tokens=len(decodes), slot_mapping=torch.tensor(slots), decode_block_tables=tables(decodes),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32), prefill_block_tables=tables(prefills),
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32),
        prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32), decode_context_lens_host=decode_lens,
        prefill_query_start_host=starts, prefill_context_lens_host=prefill_lens)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_paged_latent_cache_matches_hf_through_chunked_prefill_and_batched_decode(models, absorb, monkeypatch):
    """Two sequences in scattered blocks: prefills side by side, a second prefill chunk over cached latents next
    to a decode, then both decoding in one batch (different lengths: the padded, masked path) and one alone."""
    hf, ours, _, _ = models
    monkeypatch.setattr(MultiHeadLatentAttention, "absorb_decode", absorb)
    block_size = 8
    spec = KVSpec.for_model(ours.config, block_size, torch.float32)
    pool = PagedKVPool(spec, 10, "cpu")
    seqs = {"a": (prompts()[2][:40], [7, 2, 9, 0, 4]), "b": (prompts(seed=2)[1] + prompts(seed=3)[0][:2], [1, 8, 3])}
    assert len(seqs["b"][0]) == 22
    steps = [[("a", 0, 17), ("b", 0, 20)], [("b", 20, 1), ("a", 17, 13)]]
    steps += [[("a", 30 + i, 1), ("b", 21, 1)] if i == 0 else [("a", 30 + i, 1)] for i in range(10)]
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for step in steps:
        ids = [t for name, cached, new in step for t in seqs[name][0][cached:cached + new]]
        pos = [p for _, cached, new in step for p in range(cached, cached + new)]
        md = step_metadata([(seqs[name][1], cached, new) for name, cached, new in step], block_size)
        with torch.no_grad():
            hidden = ours(torch.tensor(ids), torch.tensor(pos), ForwardContext(PagedKVCache(pool, md, TORCH_BACKEND)))
            logits = ours.compute_logits(hidden)
        row = 0
        for name, _, new in step:
            got[name].append(logits[row:row + new])
            row += new
    for name, (ids, _) in seqs.items():
        torch.testing.assert_close(torch.cat(got[name]), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    # The pool holds latents only: one row of kv_lora_rank + qk_rope_head_dim per token, and no V.
    assert pool.k.shape == (3, 10, block_size, 1, 40) and pool.v.numel() == 0


def test_greedy_generation_matches_hf_generate(models):
    hf, _, folder, _ = models
    llm = LLM(folder, device="cpu")
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=24))
    for ids, out in zip(prompts(), outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist()


def test_yarn_rope_of_the_real_deepseek_v3_matches_hf():
    """DeepSeek-V3's own YaRN (factor 40 over 4096 positions) against HF's: frequencies, the cos/sin factor and
    the softmax scale."""
    import math

    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minipd.layers.mla import mla_softmax_scale
    from minipd.layers.rotary import inverse_frequencies, rope_attention_factor

    ds = costs.preset("deepseek-v3")
    for mscale in (1.0, 0.707):  # DeepSeek-V3's, and one where the cos/sin factor is not 1
        params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                  "mscale": mscale, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
        hf_cfg = DeepseekV3Config(rope_parameters=params, max_position_embeddings=163840)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        rope = dataclasses.replace(ds.rope, mscale=mscale)
        torch.testing.assert_close(inverse_frequencies(64, rope), inv_freq.float(), rtol=0, atol=0)
        assert rope_attention_factor(rope) == pytest.approx(factor)
    # 1/sqrt(192), times (0.1 * ln 40 + 1)^2 from mscale_all_dim.
    assert mla_softmax_scale(ds) == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_multi_token_prediction_layers_in_a_checkpoint_are_skipped(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = make_deepseek(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # DeepSeek-V3's MTP layer follows the last
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours, _ = load_model(tmp_path, device="cpu", dtype=torch.float32)
    ids = prompts()[1]
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


# --- the engine -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    """One model (a query bottleneck, grouped routing, a dense layer) and HF references for two workloads."""
    folder = tmp_path_factory.mktemp("deepseek-engine")
    hf = make_deepseek(folder, seed=1, q_lora_rank=24, max_position_embeddings=512)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, VOCAB, (24,), generator=gen).tolist()
    lengths = torch.randint(2, 60, (10,), generator=gen).tolist()
    workloads = {"mixed": [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths],
                 "shared": [prefix + torch.randint(1, VOCAB, (n // 3,), generator=gen).tolist() for n in lengths]}
    refs = {}
    for key, batch in workloads.items():
        refs[key] = []
        for ids, p in zip(batch, params_for(batch), strict=True):
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=p.max_tokens, do_sample=False, pad_token_id=0)
            refs[key].append(out[0, len(ids):].tolist())
    return folder, workloads, refs


def params_for(batch: list[list[int]]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=1 + (5 * i) % 14) for i in range(len(batch))]


ENGINE_CONFIGS = {
    "default": {},
    "chunked-prefill": dict(max_num_batched_tokens=19),
    "preemption": dict(num_kv_blocks=14, block_size=4),
}


@pytest.mark.parametrize("name", ENGINE_CONFIGS)
@pytest.mark.parametrize("workload", ["mixed", "shared"])
def test_engine_features_keep_the_greedy_tokens(engine_model, name, workload):
    folder, workloads, refs = engine_model
    batch = workloads[workload]
    llm = LLM(folder, device="cpu", **ENGINE_CONFIGS[name])
    outputs = llm.generate(batch, params_for(batch))
    assert [o.token_ids for o in outputs] == refs[workload]
    stats = list(llm.engine.step_stats)
    if name == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if name == "chunked-prefill":
        assert max(s.num_tokens for s in stats) <= 19
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
    if workload == "shared":
        assert sum(o.metrics.cached_tokens for o in outputs) > 0  # prefix caching reused latent blocks
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_kv_bytes_per_token_is_the_latent(engine_model):
    folder, _, _ = engine_model
    llm = LLM(folder, device="cpu", dtype="float32")
    cfg = llm.engine.core.model.config
    latent = cfg.num_hidden_layers * (32 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x fp32
    assert llm.kv_bytes_per_token == latent == cfg.kv_bytes_per_token(4) == costs.kv_bytes_per_token(cfg, 4)
    # The same attention caching a K (16 + 8) and a V (16) for each of its 4 heads would store 4x as much.
    mha = costs.mha_kv_bytes_per_token(cfg, 4)
    assert mha == cfg.num_hidden_layers * 4 * (24 + 16) * 4 and mha / latent == 4.0
    pool = llm.engine.core.pool
    assert pool.k.shape[-2:] == (1, 40) and pool.v.numel() == 0
    assert pool.nbytes == pool.num_tokens * latent


def test_options_that_need_per_head_kv_are_refused_by_name(engine_model):
    folder, workloads, _ = engine_model
    for dtype in ("int8", "fp8", "int4"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{dtype}'.*multi-head latent attention"):
            LLM(folder, device="cpu", kv_cache_dtype=dtype)
    with pytest.raises(ValueError, match=r"kv_adaptive_format.*multi-head latent attention"):
        LLM(folder, device="cpu", kv_cache_dtype="adaptive", enable_prefix_caching=False)
    for press in ("knorm", "h2o"):  # one scores the cached keys, the other the attention they receive
        with pytest.raises(ValueError, match=r"kv_eviction.*multi-head latent attention"):  # when built, not later
            LLM(folder, device="cpu", kv_eviction=press, kv_budget=16, block_size=8)
    llm = LLM(folder, device="cpu")
    with pytest.raises(ValueError, match=r"exported.*multi-head latent attention"):
        llm.engine.core.pool.export_blocks([0], 1)
    # A floating-point cache dtype is a plain latent pool in that dtype, and still generates.
    half = LLM(folder, device="cpu", kv_cache_dtype="bfloat16")
    assert half.kv_bytes_per_token == llm.kv_bytes_per_token / 2
    assert len(half.generate(workloads["mixed"][:1], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not run on this machine)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_greedy_tokens_equal_hf(engine_model, backend):
    """On CUDA in fp32 the latent pool and MLA attention give HF's tokens with either kernel backend (the MLA
    attention itself is torch on both); bf16 runs and gives every block back."""
    folder, workloads, refs = engine_model
    batch = workloads["shared"]
    llm = LLM(folder, device="cuda", dtype=torch.float32, kernel_backend=backend, max_num_batched_tokens=19)
    assert [o.token_ids for o in llm.generate(batch, params_for(batch))] == refs["shared"]
    bf16 = LLM(folder, device="cuda", kernel_backend=backend)
    outs = bf16.generate(batch, SamplingParams(temperature=0.8, seed=1, max_tokens=16))
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert bf16.engine.block_manager.num_used_blocks == 0
