"""Chapter 05 checkers against planted bugs (the three states of every checker: test_exercise_states.py).

The references also agree with minipd itself: the KV bytes per token with ``minipd.sim.costs``, and the
bytes per request with what ``DisaggregatedLLM`` measures (when NIXL is installed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from minipd.exercises import ch05
from minipd.exercises.checking import CheckResult
from minipd.pd.transport import nixl_available


def checker(name: str) -> Callable[[Any], CheckResult]:
    return getattr(ch05, f"check_{name}")


# --- planted bugs --------------------------------------------------------------------------------


def bytes_exact_tokens(shape, prompt_len, block_size=16, dtype_bytes=2):
    """Counts the prompt's tokens, not the whole blocks that move."""
    return ch05.reference_kv_transfer_bytes(shape, prompt_len, 1, dtype_bytes)


def bytes_k_only(shape, prompt_len, block_size=16, dtype_bytes=2):
    """Forgets V (or, for MLA, counts the latent once but everything else half)."""
    return ch05.reference_kv_transfer_bytes(shape, prompt_len, block_size, dtype_bytes) // 2


def bytes_mla_as_mha(shape, prompt_len, block_size=16, dtype_bytes=2):
    """Treats MLA's latent as if K and V were both stored at that width."""
    if "kv_lora_rank" in shape:
        per_layer = 2 * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"])
        return math.ceil(prompt_len / block_size) * block_size * shape["num_hidden_layers"] * per_layer * dtype_bytes
    return ch05.reference_kv_transfer_bytes(shape, prompt_len, block_size, dtype_bytes)


def ready_no_overlap(prefill_s, transfer_s, num_layers, mode):
    """Layer-wise sending that overlaps nothing."""
    return prefill_s + transfer_s


def ready_perfect_overlap(prefill_s, transfer_s, num_layers, mode):
    """Forgets the last layer's transfer, which nothing can hide."""
    if mode == "pull":
        return prefill_s + transfer_s
    return max(prefill_s, transfer_s)


def route_fewest_free(free_blocks, request_tokens, block_size=16):
    """Picks the fullest worker."""
    free, out = list(free_blocks), []
    for tokens in request_tokens:
        w = min(range(len(free)), key=lambda i: free[i])
        free[w] -= -(-tokens // block_size)
        out.append(w)
    return out


def route_no_reservation(free_blocks, request_tokens, block_size=16):
    """Does not count the blocks of requests already routed."""
    return [max(range(len(free_blocks)), key=lambda i: free_blocks[i]) for _ in request_tokens]


def route_last_on_ties(free_blocks, request_tokens, block_size=16):
    """Breaks ties towards the highest index."""
    free, out = list(free_blocks), []
    for tokens in request_tokens:
        w = max(range(len(free)), key=lambda i: (free[i], i))
        free[w] -= -(-tokens // block_size)
        out.append(w)
    return out


BUGS = [
    ("kv_transfer_bytes", bytes_exact_tokens),
    ("kv_transfer_bytes", bytes_k_only),
    ("kv_transfer_bytes", bytes_mla_as_mha),
    ("kv_ready_time", ready_no_overlap),
    ("kv_ready_time", ready_perfect_overlap),
    ("route_decode", route_fewest_free),
    ("route_decode", route_no_reservation),
    ("route_decode", route_last_on_ties),
]


@pytest.mark.parametrize(("name", "bug"), BUGS, ids=[b.__name__ for _, b in BUGS])
def test_planted_bug_fails_with_where(name: str, bug: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    result = checker(name)(bug)
    assert result.status == "FAIL"
    assert result.max_diff is not None and result.max_diff > 0
    assert result.first_mismatch is not None
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {name}: max |diff|") and "first mismatch in case" in out


def test_fail_message_names_the_case_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    ch05.check_kv_transfer_bytes(bytes_exact_tokens)
    out = capsys.readouterr().out.strip()
    assert out.startswith("FAIL kv_transfer_bytes: max |diff| ")
    assert "first mismatch in case 0 (tiny-py, 8 tokens (one block, fp32)): got 24576, expected 49152" in out


def test_route_fail_points_at_the_first_differing_request(capsys: pytest.CaptureFixture[str]) -> None:
    result = ch05.check_route_decode(route_no_reservation)
    assert result.first_mismatch == 1  # the second request of "alternating as blocks are reserved"
    assert "at request 1: got worker 0, expected 1" in capsys.readouterr().out


# --- the references agree with minipd ------------------------------------------------------------


def test_kv_bytes_per_token_agrees_with_costs() -> None:
    from minipd.sim.costs import kv_bytes_per_token, preset

    for name, key in (("Llama-3-8B", "llama-3-8b"), ("Llama-2-7B", "llama-2-7b")):
        assert ch05.reference_kv_transfer_bytes(ch05.MODEL_SHAPES[name], 1, 1, 2) == kv_bytes_per_token(preset(key))


def test_mla_bytes_per_token() -> None:
    # DeepSeek-V3: 61 layers x (512 latent + 64 rotary key) x 2 bytes.
    assert ch05.reference_kv_transfer_bytes(ch05.MODEL_SHAPES["DeepSeek-V3"], 1, 1, 2) == 61 * 576 * 2


@pytest.mark.skipif(nixl_available() is not None, reason=f"needs NIXL: {nixl_available()}")
def test_kv_bytes_match_what_disaggregated_llm_moves() -> None:
    from minipd import LLM, DisaggregatedLLM, SamplingParams

    llm = LLM("tiny-py")
    shape = {k: getattr(llm.config, k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")}
    prompts = [[(7 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate([5, 16, 17, 70])]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with DisaggregatedLLM("tiny-py", enable_prefix_caching=False, start_timeout=120) as pd:
        outputs = pd.generate(prompts, params)
    dtype_bytes = llm.engine.pool.k.element_size()
    assert [o.metrics.kv_transfer_bytes for o in outputs] == [
        ch05.reference_kv_transfer_bytes(shape, len(p), 16, dtype_bytes) for p in prompts]


def test_the_layerwise_figure_agrees_with_the_exercise_reference():
    """The chapter's layer-wise transfer figure and exercise 2's reference time the same K/V arrival."""
    from minipd.viz.pd import draw_layerwise, layerwise_transfer

    for prefill_s, transfer_s, layers in ((0.032, 0.004, 32), (0.010, 0.050, 8), (0.02, 0.02, 4)):
        plan = layerwise_transfer(prefill_s, transfer_s / layers, layers, 1.0)
        assert abs(plan["kv_ready"] - ch05.reference_kv_ready_time(prefill_s, transfer_s, layers, "layerwise")) < 1e-12
        assert 0.0 <= plan["hidden_share"] <= 1.0
    ax = draw_layerwise("llama-3-8b", 4096, "400G IB", 50e9)
    assert "llama-3-8b, 4096 tokens, 400G IB" in ax.get_title() and len(ax.patches) == 2 * 32
