"""Tiny random models and a tiny tokenizer, made with transformers, for tests that must not download."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

VOCAB = 320
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nclass Path:\n    pass\n",
    "for i in range(10):\n    print(i * i)\n",
    "Hello, world! The quick brown fox jumps over the lazy dog. é ü 漢字",
] * 20


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with ``VOCAB`` ids, saved so AutoTokenizer loads it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=VOCAB, min_frequency=1, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>", pad_token="<eos>")
    tok.save_pretrained(folder)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def hf_config(family: str, tie: bool = False, **overrides):
    """A small random config of ``family`` with grouped-query attention (4 query heads per KV head)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, eos_token_id=0, bos_token_id=0, pad_token_id=0,
                  # Larger weights make the logits peaked, so greedy choices are never near-ties.
                  initializer_range=0.2)
    extra = {
        "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "mistral": dict(sliding_window=24),
        "qwen2": dict(),
        "qwen3": dict(head_dim=16),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        # A shared expert; layer 1 of 3 keeps a dense MLP; top-k probabilities not renormalised.
        "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                          shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1],
                          num_hidden_layers=3),
        # Every other layer sparse (decoder_sparse_step 2), renormalised top-k, q/k norms.
        "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=True,
                          decoder_sparse_step=2, num_hidden_layers=4, head_dim=16),
        # Multi-head latent attention (4 heads: MLA has no grouped K/V), 8 experts in 4 groups of which the
        # best 2 compete, a shared expert, layer 0 dense. Not in FAMILIES: see tests/test_deepseek_v3.py.
        "deepseek_v3": dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, kv_lora_rank=32,
                            q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                            n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5),
    }[family]
    name = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
            "qwen3": "Qwen3Config", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
            "qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config"}[family]
    return getattr(transformers, name)(**{**common, **extra, **overrides})


def make_hf_model(folder: Path, family: str, tie: bool = False, seed: int = 0, max_shard_size: str | None = None,
                  **overrides):
    """Build, save (with a tokenizer) and return a random HF model of ``family`` in fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tie, **overrides)).float().eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    save_tokenizer(folder)
    return model


def by_gid(ax, gid: str):
    """The one artist of ``ax`` (collection or line) whose gid is ``gid``: plots tag what tests read."""
    found = [a for a in [*ax.collections, *ax.lines] if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist with gid {gid!r}, found {len(found)}"
    return found[0]


def bars(ax, label: str):
    """The one bar container of ``ax`` labelled ``label``."""
    found = [c for c in ax.containers if c.get_label() == label]
    assert len(found) == 1, f"expected one bar container labelled {label!r}, found {len(found)}"
    return found[0]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_child_exits_with_its_parent(script: Path, what: str, grace: float = 20.0) -> None:
    """Run ``script`` (which prints one child pid, then sleeps), SIGKILL it, and assert the child exits
    within ``grace`` seconds; whatever happens, nothing is left running."""
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    child = -1
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        os.kill(parent.pid, signal.SIGKILL)  # no shutdown message, no clean-up: the child is on its own
        parent.wait(timeout=10)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(child):
            time.sleep(0.2)
        assert not alive(child), f"{what} outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if alive(child):
            os.kill(child, signal.SIGKILL)


def need_cpu_kernel():
    """The built C++ CPU attention extension. Where it cannot be built the test fails, unless
    ``MINIPD_NO_CPU_KERNEL=1`` says this machine has no compiler: then it is skipped, saying so."""
    import pytest

    from minipd.kernels.cpu_paged_attention import load_kernel

    module, why = load_kernel()
    if module is None:
        if os.environ.get("MINIPD_NO_CPU_KERNEL") != "1":
            pytest.fail(f"the C++ CPU kernel did not build ({why}); set MINIPD_NO_CPU_KERNEL=1 where no compiler "
                        "exists")
        pytest.skip("MINIPD_NO_CPU_KERNEL=1: the kernel is not built here (the reference is used)")
    return module


def listen_port(host: str = "127.0.0.1") -> int:
    """A free TCP port below the system's ephemeral range (:func:`minipd.pd.worker.free_port`), for a front end
    that workers connect to before it listens. Their connects are retried, and a retried connect to a port inside
    that range can be given that very port as its own source (a TCP self-connect), holding the port the front end
    then fails to bind — the likely cause of the `Address already in use` that once failed a launched-workers
    test."""
    from minipd.pd.worker import free_port

    return free_port(host)


def failed_start(start, stopped: list[int], bound: float = 60.0) -> tuple[BaseException | None, float]:
    """Run ``start`` (a start that is to fail) in a thread for at most ``bound`` seconds: what it raised and how
    long it took. Should it hang, the processes in ``stopped`` are killed so that it ends, and the test fails."""
    outcome: dict = {}

    def run() -> None:
        try:
            start()
        except Exception as err:  # (returned to the test)
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    began = time.monotonic()
    thread.start()
    thread.join(timeout=bound)
    took, hung = time.monotonic() - began, thread.is_alive()
    if hung:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        thread.join(timeout=30)
    assert not hung, f"the start hung: still running {bound:.0f} s after it began"
    return outcome.get("error"), took
