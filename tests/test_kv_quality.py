"""The KV quality harness: its full distributions are HF's, its reference scores itself perfectly, a
compressed cache costs what its error allows, and the CLI prints the table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minipd import LLM
from minipd.evaluation.kv_quality import copy_probe, format_table, measure, next_token_logprobs, windows
from minipd.models import bundled_models_dir


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py", enable_prefix_caching=False, max_num_batched_tokens=48)  # chunked: rows come in pieces


def test_next_token_logprobs_are_hf_log_softmax_row_for_row(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_models_dir() / "tiny-py", dtype=torch.float32).eval()
    (ids,) = windows(llm.tokenizer, 120, 1)
    got = next_token_logprobs(llm, ids)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert got.shape == want.shape == (120, llm.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_the_copy_probe_scores_the_identifier_after_its_first_word(llm):
    for with_def, without, (start, end, shift) in copy_probe(llm.tokenizer):
        assert 40 < start < end < len(with_def)
        assert with_def[start:end] == without[start + shift:end + shift]  # the same tokens are scored in both


def test_the_reference_scores_itself_perfectly_and_int8_costs_little():
    reports = measure("tiny-py", ["int8", "fp8"], num_windows=2, greedy_prompts=1, greedy_tokens=24, progress=False)
    auto, int8, fp8 = reports
    assert auto.method == "auto" and auto.perplexity_change == 0 and auto.mean_kl == 0 and auto.greedy_equal == 1
    cfg = LLM("tiny-py").config
    assert int8.bytes_vs_fp16 == pytest.approx((cfg.head_dim + 2) / (2 * cfg.head_dim))
    assert 0 < int8.mean_kl < fp8.mean_kl < 0.01  # fp8 rounds to 3 mantissa bits, int8 to 1/127 of the range
    assert abs(int8.perplexity_change) < 0.01
    assert "int8" in format_table(reports)


def test_the_cli_prints_the_table_and_refuses_bad_input():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "minipd", "kvquality", "--windows", "1", "--methods", "int8"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[kvquality]" in out.stdout and " auto " in out.stdout and " int8 " in out.stdout
    bad = subprocess.run([sys.executable, "-m", "minipd", "kvquality", "--methods", "int3"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "kv_cache_dtype must be one of" in bad.stderr


def test_method_names_choose_the_granularity_and_bad_ones_are_named():
    from minipd.evaluation.kv_quality import method_options

    assert method_options("int8+snapkv:64@token") == {"kv_cache_dtype": "int8", "kv_eviction": "snapkv",
                                                       "kv_budget": 64, "max_num_batched_tokens": 1,
                                                       "kv_eviction_granularity": "token"}
    assert method_options("h2o:96")["kv_eviction_granularity"] == "block"
    with pytest.raises(ValueError, match="optionally followed by @token"):
        method_options("h2o:96@page")
