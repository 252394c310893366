"""``python -m minipd generate`` and ``python -m minipd info``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import make_hf_model


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "minipd", *args], capture_output=True, text=True, env=env, timeout=300)


def test_generate_streams_text_and_reports_latency(tmp_path):
    make_hf_model(tmp_path, "llama")
    out = run_cli("generate", "def add", "--model", str(tmp_path), "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def add")
    assert re.search(r"\[6 tokens, finish: length\] TTFT [\d.]+ ms, TPOT [\d.]+ ms", out.stdout)


def test_generate_with_sampling_is_reproducible(tmp_path):
    make_hf_model(tmp_path, "qwen3")
    args = ("generate", "x", "--model", str(tmp_path), "--max-tokens", "8", "--temperature", "1.0", "--seed", "5")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    text = lambda r: r.stdout.split("\n\n[")[0]  # noqa: E731 - the generated part, without timings
    assert text(first) == text(second)


def test_bad_arguments_give_a_clear_error(tmp_path):
    out = run_cli("generate", "x", "--model", "no-such-model")
    assert out.returncode == 2
    assert "tiny-py" in out.stderr
    make_hf_model(tmp_path, "llama")
    out = run_cli("generate", "x", "--model", str(tmp_path), "--top-p", "0")
    assert out.returncode == 2 and "top_p" in out.stderr


def test_info_lists_models_device_and_backends():
    out = run_cli("info")
    assert out.returncode == 0, out.stderr
    assert "tiny-py" in out.stdout and "tiny-py-moe" in out.stdout
    assert "device: cpu" in out.stdout or "device: cuda" in out.stdout
    assert "torch" in out.stdout and "triton" in out.stdout
