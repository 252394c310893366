"""Chapter 05 checkers against planted bugs (the three states of every checker: test_exercise_states.py).

The formula checkers fail bugs on fixed cases. The router checkers fail bugs by what a running cluster
(one prefill, two decode workers) did with them: a decode sent to the fuller worker, a prompt admitted
that should have waited in the front end, a cluster that stalled with every prompt held back. Each of
those tests starts a cluster (tens of seconds on two shared cores). The references also agree with
minipd itself: the KV bytes per token with ``minipd.sim.costs``, the bytes per request with what
``DisaggregatedLLM`` measures (when NIXL is installed), and the router's two rules with
:class:`minipd.pd.routing.Router`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from minipd.exercises import ch05
from minipd.exercises.checking import CheckResult
from minipd.pd.routing import Router
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


BUGS = [
    ("kv_transfer_bytes", bytes_exact_tokens),
    ("kv_transfer_bytes", bytes_k_only),
    ("kv_transfer_bytes", bytes_mla_as_mha),
    ("kv_ready_time", ready_no_overlap),
    ("kv_ready_time", ready_perfect_overlap),
]


def stub(*args):
    raise NotImplementedError


def decode_fewest_requests(workers):
    """The prefill's rule (the least busy worker) for a decode: blind to how much memory each request holds."""
    return min(workers, key=lambda w: w.num_requests)


def decode_fewest_free(workers):
    """Picks the fullest worker."""
    return min(workers, key=lambda w: w.free_blocks)


def room_always(decoders, on_their_way, needed):
    """No backpressure: every prompt is prefilled at once."""
    return True


def room_ignores_prefills_on_their_way(decoders, on_their_way, needed):
    """Looks at the free blocks only, as if the prompts already prefilling needed no room."""
    return not decoders or max(w.free_blocks for w in decoders) >= needed


def room_never(decoders, on_their_way, needed):
    """Holds every prompt back: nothing ever runs."""
    return False


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


# --- the router exercises: plugged into a running cluster -----------------------------------------


def test_router_references_make_the_engines_choices() -> None:
    draw = random.Random(5)
    router = Router()
    for _ in range(500):
        views = [ch05.WorkerView(f"decode{i}", draw.randrange(0, 40), draw.randrange(0, 5))
                 for i in range(draw.randrange(1, 4))]
        on_their_way = [draw.randrange(1, 8) for _ in range(draw.randrange(0, 6))]
        needed = draw.randrange(1, 12)
        assert ch05.reference_decode_worker(views) is router.decode_worker(views)
        assert ch05.reference_decode_has_room(views, on_their_way, needed) == \
            router.decode_has_room(views, on_their_way, needed)
    assert ch05.reference_decode_has_room([], [5], 100)  # no decode worker: the prefill workers decode


def test_reader_router_records_decisions_and_keeps_the_cluster_sound() -> None:
    """Without processes: what the cluster gets back from a ReaderRouter, and what it keeps for the checker."""
    loads = [ch05.WorkerView("decode0", 5, 0), ch05.WorkerView("decode1", 9, 2)]
    router = ch05.ReaderRouter(decode_worker=decode_fewest_free, decode_has_room=room_always)
    assert router.decode_worker(loads) is loads[0]  # the reader's choice is what the cluster uses
    assert router.decode_has_room(loads, [8], 6) is True
    assert router.decode_has_room(loads, [8], 6) is True  # the same question again: recorded once
    first, second = router.decisions
    assert (first.answer, first.expected, first.right) == ("decode0", "decode1", False)
    assert (second.answer, second.expected, second.right, second.on_their_way) == (True, False, False, (8,))
    assert router.failure is None
    # An answer the cluster cannot use is kept for the checker, and the reference's is used instead.
    broken = ch05.ReaderRouter(decode_worker=lambda ws: ws[0].name, decode_has_room=lambda d, o, n: max(o) > 0)
    assert broken.decode_has_room(loads, [], 3) is True and broken.failure[0] == "fail"
    assert "ValueError" in broken.failure[1]
    assert broken.decode_worker(loads) is loads[1]
    untouched = ch05.ReaderRouter(decode_worker=stub)
    assert untouched.decode_worker(loads) is loads[1] and untouched.failure == ("todo", "")


@pytest.mark.parametrize("name", ["decode_worker", "decode_has_room"])
def test_router_checkers_start_no_cluster_for_a_stub_or_a_broken_function(name, monkeypatch) -> None:
    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(ch05, "run_cluster", no_cluster)
    check = checker(name)
    assert check(stub).status == "TODO"
    for bad in (lambda *a: None, lambda *a: "decode0", lambda *a: 1 / 0, 3):
        result = check(bad)
        assert result.status == "FAIL" and ("before the cluster" in result.message or "function" in result.message)


ENGINE_BUGS = [
    ("decode_worker", decode_fewest_requests, "the rule sends it to"),
    ("decode_worker", decode_fewest_free, "the rule sends it to"),
    ("decode_has_room", room_always, "the engine held back 0 of 16 prompts"),
    ("decode_has_room", room_ignores_prefills_on_their_way, "so the engine sent the prompt to prefill"),
    ("decode_has_room", room_never, "the cluster stalled: 16 prompts held back"),
]


@pytest.mark.parametrize(("name", "bug", "what_the_engine_did"), ENGINE_BUGS,
                         ids=[b.__name__ for _, b, _ in ENGINE_BUGS])
def test_router_bugs_fail_by_what_the_cluster_did(name, bug, what_the_engine_did, capsys) -> None:
    result = checker(name)(bug)
    out = capsys.readouterr().out
    assert result.status == "FAIL", out
    assert result.max_diff is not None and result.max_diff > 0 and result.first_mismatch is not None
    assert out.startswith(f"FAIL {name}: max |diff| ") and "first mismatch at" in out
    assert what_the_engine_did in out

