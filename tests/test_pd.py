"""Prefill/decode disaggregation: workers in separate processes, K/V read over NIXL (or torch.distributed).

Outputs equal a single engine's token for token (greedy and seeded); a decode worker killed mid-run
changes nothing but the route; with no decode worker left the prefill worker decodes; blocks held for
a reader that died are freed by the lease; ``shutdown`` leaves no process behind. Every test bounds
its workers in time and shuts them down, also when it fails.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import pytest
from pd_helpers import assert_gone, llm, mixed, needs_nixl, run_killing, tokens, wait_until_blocks_free

from minipd import LLM, DisaggregatedLLM, SamplingParams

__all__ = ["llm"]  # a fixture, imported for pytest


@needs_nixl
@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_one_prefill_two_decode_workers_give_the_single_engine_outputs(llm, mode):
    prompts, params = mixed(llm)
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", num_decode_workers=2, kv_transfer=mode, kv_lease_s=20, start_timeout=120) as pd:
        pids = [p for group in pd.worker_pids().values() for p in group]
        assert len(pids) == 3 and os.getpid() not in pids
        outputs = pd.generate(prompts, params)
        assert tokens(outputs) == expected
        decoded = [o for o in outputs if o.metrics.decode_worker]
        assert {o.metrics.decode_worker for o in decoded} == {"decode0", "decode1"}
        assert all(o.metrics.prefill_worker == "prefill0" for o in outputs)
        # Each decoded request moved exactly its prompt's blocks, and none was recomputed there.
        per_block = 2 * llm.config.num_hidden_layers * 16 * llm.config.num_key_value_heads * llm.config.head_dim * 4
        for o in decoded:
            assert o.metrics.kv_transfer_bytes == -(-len(o.prompt_token_ids) // 16) * per_block
            assert o.metrics.kv_transfer_end >= o.metrics.kv_transfer_start
            assert o.metrics.prefill_tokens + o.metrics.cached_tokens == len(o.prompt_token_ids)
        streamed = list(pd.stream(prompts[0], params[0]))
        assert [d.token_id for d in streamed] == expected[0][0]
        wait_until_blocks_free(pd)
    assert_gone(pids)


@needs_nixl
@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_a_decode_worker_killed_mid_run_changes_nothing_but_the_route(llm, mode):
    prompts, params = mixed(llm)
    params = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=48, ignore_eos=True)
              for p in params]
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", num_decode_workers=2, kv_transfer=mode, kv_lease_s=2, start_timeout=120) as pd:
        outputs = run_killing(pd, prompts, params, "decode", after_tokens=200)
        assert len(pd.worker_pids()["decode"]) == 1
        assert pd.num_recovered_requests > 0  # it died holding requests, which finished elsewhere
        assert tokens(outputs) == expected
        wait_until_blocks_free(pd)  # blocks held for the dead reader are freed by the lease


@needs_nixl
def test_with_no_decode_worker_left_the_prefill_worker_decodes(llm):
    prompts, params = mixed(llm, 8)
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", kv_lease_s=2, start_timeout=120) as pd:
        (decoder,) = pd.worker_pids()["decode"]
        os.kill(decoder, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pd.worker_pids()["decode"] and time.monotonic() < deadline:
            time.sleep(0.05)
        outputs = pd.generate(prompts, params)
        assert tokens(outputs) == expected
        assert {o.metrics.decode_worker for o in outputs if o.metrics.decode_worker} <= {"prefill0"}
        wait_until_blocks_free(pd)


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="kv_transfer must be one of 'pull', 'push', 'layerwise'"):
        DisaggregatedLLM("tiny-py", kv_transfer="teleport")
    with pytest.raises(ValueError, match="kv_transport must be one of 'nixl', 'torch'"):
        DisaggregatedLLM("tiny-py", kv_transport="carrier-pigeon")
    with pytest.raises(ValueError, match="num_prefill_workers"):
        DisaggregatedLLM("tiny-py", num_prefill_workers=0)
    with pytest.raises(ValueError, match="unknown engine option"):
        DisaggregatedLLM("tiny-py", not_an_option=1)


@needs_nixl
@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_a_prefill_worker_killed_mid_run_changes_nothing_but_the_route(llm, mode):
    prompts, params = mixed(llm)
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", num_prefill_workers=2, kv_transfer=mode, kv_lease_s=2, start_timeout=120) as pd:
        outputs = run_killing(pd, prompts, params, "prefill", after_tokens=0)  # killed with prompts in flight
        assert len(pd.worker_pids()["prefill"]) == 1
        assert pd.num_recovered_requests > 0
        assert tokens(outputs) == expected
        wait_until_blocks_free(pd)


@needs_nixl
def test_full_decode_pools_hold_new_prompts_back(llm):
    prompts, params = mixed(llm, 16)
    params = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=24, ignore_eos=True) for p in params]
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", num_kv_blocks=24, kv_lease_s=5, start_timeout=120) as pd:
        with pytest.raises(ValueError, match="pools have 24 blocks"):
            pd.generate([list(range(1, 400))], SamplingParams(max_tokens=8))
        outputs = pd.generate(prompts, params)
        assert pd.num_backpressured > 0  # some prompts waited in the front end for decode room
        assert tokens(outputs) == expected
        wait_until_blocks_free(pd)


def test_torch_distributed_transport_gives_the_same_outputs_in_every_mode(llm):
    """The fallback for platforms without NIXL: reads and acknowledged writes over gloo point-to-point
    messages, with chunked prefill so layer-wise writes span several steps."""
    prompts, params = mixed(llm, 16)
    expected = tokens(llm.generate(prompts, params))
    per_block = 2 * llm.config.num_hidden_layers * 16 * llm.config.num_key_value_heads * llm.config.head_dim * 4
    with DisaggregatedLLM("tiny-py", kv_transport="torch", max_num_batched_tokens=32, kv_lease_s=20,
                          start_timeout=120) as pd:
        pids = [p for group in pd.worker_pids().values() for p in group]
        info = pd.describe()  # what the cluster really runs with, each role's engine as its worker reported
        assert info["kv_transport"] == "torch" and info["num_prefill_workers"] == info["num_decode_workers"] == 1
        assert info["decode_engine"]["linear_backend"] in ("torch", "onednn", "cpu"), info
        assert "kv_transport='torch'" in repr(pd)
        for mode in ("pull", "push", "layerwise"):
            pd.kv_transfer = mode
            outputs = pd.generate(prompts, params)
            assert tokens(outputs) == expected, mode
            assert pd.num_recovered_requests == 0, mode
            moved = [o for o in outputs if o.metrics.decode_worker == "decode0"]
            short = [(o.request_id, len(o.prompt_token_ids), o.metrics.kv_transfer_bytes, o.metrics.cached_tokens)
                     for o in moved if o.metrics.kv_transfer_bytes < -(-len(o.prompt_token_ids) // 16) * per_block]
            assert moved and not short, (mode, per_block, short, pd.describe(), pd.worker_pids(),
                                         [(o.request_id, o.metrics.kv_timeline) for o in moved if o.request_id in
                                          {r for r, *_ in short}])
            assert all(o.metrics.kv_timeline.mode == mode for o in moved)
            wait_until_blocks_free(pd)
        # Each worker's step records reached the front end, named by worker.
        stats = list(pd.step_stats)
        assert {s.worker for s in stats} == {"prefill0", "decode0"} and pd.core.num_steps == len(stats)
        assert sum(s.num_prefill_tokens for s in stats if s.worker == "prefill0") > 0
        assert sum(s.num_decode_tokens for s in stats if s.worker == "decode0") > 0
        # Each worker measured its loop's own work before each step: never more than the time since its previous
        # step ended; all of it while the worker still had requests running (it never waited for a message then).
        # Both are on the worker's clock (perf_counter: one clock for every process of the machine).
        for worker in ("prefill0", "decode0"):
            mine = [s for s in stats if s.worker == worker]
            assert all(s.overhead_before is not None and s.overhead_before >= 0 for s in mine), worker
            pairs = list(itertools.pairwise(mine))
            assert all(b.overhead_before <= b.start_time - (a.start_time + a.duration) + 1e-6 for a, b in pairs)
            running = [(a, b) for a, b in pairs if a.num_running > 0]
            assert worker == "prefill0" or running
            assert all(b.overhead_before == pytest.approx(b.start_time - (a.start_time + a.duration), abs=1e-6)
                       for a, b in running), worker
        # (Waits for a core are measured on Linux only.)
        assert all((s.cpu_wait is not None) == sys.platform.startswith("linux") for s in stats)
    assert_gone(pids)


def test_writes_that_land_late_never_reach_blocks_given_to_another_request(llm):
    """A request that ends at its first token lets go of its decode reservation while layer-wise writes
    into it may still be arriving. Those blocks are the next ones a growing decode takes, so the decode
    worker must keep them until the prefill worker says its writes are over, or a late write would
    overwrite a running request's K/V. Writes are slowed on purpose to hold that window open."""
    ids = llm.tokenizer.encode("def parse(argv=None):\n    parser = argparse.ArgumentParser()\n" * 8)
    runners = [ids[i:i + 12] for i in range(4)]
    one_token = [ids[i:i + 80] for i in range(4, 10)]
    run_params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    one_params = SamplingParams(temperature=0, max_tokens=1)
    expected = tokens(llm.generate(runners + one_token, [run_params] * 4 + [one_params] * 6))
    with DisaggregatedLLM("tiny-py", kv_transport="torch", enable_prefix_caching=False, kv_lease_s=20,
                          start_timeout=120) as pd:
        pd.inject_fault("decode0", "slow_writes")
        with pytest.raises(ValueError, match="fault must be"):
            pd.inject_fault("decode0", "gremlins")
        states = [pd.processor.states[pd.add_request(p, run_params)] for p in runners]
        deadline = time.monotonic() + 60
        while min(len(s.token_ids) for s in states) < 4:  # decoding, about to need new blocks
            assert time.monotonic() < deadline
            pd.step()
        states += [pd.processor.states[pd.add_request(p, one_params)] for p in one_token]
        while not all(s.finished for s in states):
            assert time.monotonic() < deadline
            pd.step()
        assert tokens([s.to_output() for s in states]) == expected
        assert pd.num_recovered_requests == 0
        wait_until_blocks_free(pd)


@needs_nixl
def test_a_read_that_never_completes_runs_into_its_lease_and_is_recomputed(llm):
    prompts, params = mixed(llm, 8)
    params = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=12, ignore_eos=True) for p in params]
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", kv_transfer="pull", kv_lease_s=1.0, start_timeout=120) as pd:
        pd.inject_fault("decode0", "lose_reads")
        start = time.monotonic()
        outputs = pd.generate(prompts, params)
        assert time.monotonic() - start < 30
        assert tokens(outputs) == expected
        assert pd.num_recovered_requests == len(prompts)  # every read was lost; each request was recomputed
        assert all(o.metrics.kv_transfer_bytes == 0 for o in outputs)
        wait_until_blocks_free(pd)  # the prefill worker's held copies were freed by their lease


@needs_nixl
@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_one_prefill_one_decode_worker_with_chunked_prefill_give_the_single_engine_outputs(llm, mode):
    """1P1D on the 32-request batch. In the push modes the decode worker reserves blocks first and the
    prefill worker writes into them — after the prefill ("push") or layer by layer while the next layer
    computes ("layerwise"), across the chunks of a chunked prefill."""
    prompts, params = mixed(llm)
    expected = tokens(llm.generate(prompts, params))
    with DisaggregatedLLM("tiny-py", kv_transfer=mode, max_num_batched_tokens=32, kv_lease_s=20,
                          start_timeout=120) as pd:
        outputs = pd.generate(prompts, params)
        assert tokens(outputs) == expected
        assert pd.num_recovered_requests == 0
        moved = [o for o in outputs if o.metrics.decode_worker == "decode0"]
        per_block = 2 * llm.config.num_hidden_layers * 16 * llm.config.num_key_value_heads * llm.config.head_dim * 4
        # Every prompt block arrives; layer-wise, a partly filled block is sent again with the next chunk.
        assert moved and all(o.metrics.kv_transfer_bytes >= -(-len(o.prompt_token_ids) // 16) * per_block
                             for o in moved)
        wait_until_blocks_free(pd)  # reservations of requests that ended at their first token were given back


@needs_nixl
def test_the_transfer_mode_can_change_between_requests_and_each_request_carries_its_timeline(llm):
    """One pair of workers serves all three modes; every request's measured events tell them apart:
    pull moves nothing until the prefill step ended, push writes everything once after it, layer-wise
    posts one write per layer inside the step, each after its layer stored its K/V."""
    prompt = llm.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = tokens(llm.generate([prompt], params))
    layers = llm.config.num_hidden_layers
    with DisaggregatedLLM("tiny-py", enable_prefix_caching=False, kv_lease_s=20, start_timeout=120) as pd:
        by_mode = {}
        for mode in ("pull", "push", "layerwise"):
            pd.kv_transfer = mode
            by_mode[mode] = pd.generate([prompt], params)
            assert tokens(by_mode[mode]) == expected
        with pytest.raises(ValueError, match="kv_transfer must be one of"):
            pd.kv_transfer = "teleport"
        assert pd.kv_transfer == "layerwise"  # a refused value changes nothing
        wait_until_blocks_free(pd)
    for mode, (out,) in by_mode.items():
        t = out.metrics.kv_timeline
        assert t is not None and t.mode == mode
        step_start, step_end = t.prefill_step
        assert len(t.layers) == layers
        bounds = [step_start] + [x for pair in t.layers for x in pair] + [step_end]
        assert bounds == sorted(bounds), f"{mode}: layer events out of order"
        first, last = t.transfer
        assert first <= last <= out.metrics.token_times[1]  # all K/V there before decode's first token
        if mode == "pull":
            assert t.sends == [] and first >= step_end
        elif mode == "push":
            assert [layer for layer, _, _ in t.sends] == [None] and first >= step_end
        else:
            assert [layer for layer, _, _ in t.sends] == list(range(layers))
            for (layer, posted, _), (_, stored) in zip(t.sends, t.layers, strict=True):
                assert stored <= posted < step_end, f"layer {layer}'s write was not posted inside the step"
            assert out.metrics.kv_transfer_hidden > 0.5


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=needs_nixl), "torch"])
def test_a_quantized_pool_moves_its_codes_and_scales(llm, transport):
    """int8 K/V travel with their scales (every transport, every mode) and cost their compressed bytes."""
    prompts, params = mixed(llm, 12)
    single = LLM("tiny-py", kv_cache_dtype="int8")
    expected = tokens(single.generate(prompts, params))
    per_block = single.engine.core.kv_spec.bytes_per_block
    with DisaggregatedLLM("tiny-py", kv_cache_dtype="int8", kv_transport=transport, kv_lease_s=20,
                          start_timeout=120) as pd:
        for mode in ("pull", "push", "layerwise"):
            pd.kv_transfer = mode
            outputs = pd.generate(prompts, params)
            assert tokens(outputs) == expected, mode
            moved = [o for o in outputs if o.metrics.decode_worker == "decode0"]
            assert moved and all(o.metrics.kv_transfer_bytes == -(-len(o.prompt_token_ids) // 16) * per_block
                                 for o in moved), mode
        wait_until_blocks_free(pd)


def test_a_kivi_pool_moves_its_codes_and_the_filling_block_crosses_as_codes(llm):
    """int4 (KIVI) over PD: full blocks are bit-exact codes; the prompt's partly filled last block travels
    as its sealed codes (its residual rows stay behind), so the decode worker goes on from int4 values
    of those few tokens where one engine kept them exact: greedy tokens agree closely, not exactly."""
    prompts, _ = mixed(llm, 6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    single = LLM("tiny-py", kv_cache_dtype="int4")
    expected = [o.token_ids for o in single.generate(prompts, params)]
    per_block = single.engine.core.kv_spec.bytes_per_block
    with DisaggregatedLLM("tiny-py", kv_cache_dtype="int4", kv_transport="torch", kv_lease_s=20,
                          start_timeout=120) as pd:
        outputs = pd.generate(prompts, params)
        wait_until_blocks_free(pd)
    got = [o.token_ids for o in outputs]
    same = [a == b for x, y in zip(got, expected, strict=True) for a, b in zip(x, y, strict=True)]
    assert sum(same) / len(same) > 0.8 and all(x[0] == y[0] for x, y in zip(got, expected, strict=True))
    moved = [o for o in outputs if o.metrics.decode_worker == "decode0"]
    assert moved and all(o.metrics.kv_transfer_bytes == -(-len(o.prompt_token_ids) // 16) * per_block for o in moved)


def test_a_float_pool_can_be_compressed_on_the_wire_only(llm):
    """kv_transfer_dtype='int8': both pools keep fp32, the blocks travel as int8 codes and scales (0.27x of
    fp32's bytes on tiny-py), and the decode worker continues from the prompt's K/V rounded to int8."""
    prompts, _ = mixed(llm, 6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    cfg = llm.config
    fp32_block = llm.engine.core.kv_spec.bytes_per_block
    wire_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * (cfg.head_dim + 2)
    with DisaggregatedLLM("tiny-py", kv_transport="torch", kv_transfer_dtype="int8", kv_lease_s=20,
                          start_timeout=120) as pd:
        for mode in ("pull", "push", "layerwise"):
            pd.kv_transfer = mode
            outputs = pd.generate(prompts, params)
            got = [o.token_ids for o in outputs]
            same = [a == b for x, y in zip(got, expected, strict=True) for a, b in zip(x, y, strict=True)]
            assert sum(same) / len(same) > 0.8, mode
            moved = [o for o in outputs if o.metrics.decode_worker == "decode0"]
            assert moved and all(o.metrics.kv_transfer_bytes == -(-len(o.prompt_token_ids) // 16) * wire_block
                                 for o in moved), mode
        wait_until_blocks_free(pd)
    assert wire_block / fp32_block == pytest.approx(0.2656, abs=1e-3)
    with pytest.raises(ValueError, match="kv_transfer_dtype must be None or one of 'int8'"):
        DisaggregatedLLM("tiny-py", kv_transport="torch", kv_transfer_dtype="int3")
    with pytest.raises(ValueError, match="travel compressed already"):
        DisaggregatedLLM("tiny-py", kv_transport="torch", kv_transfer_dtype="int8", kv_cache_dtype="int8")


def test_logprobs_come_back_from_both_workers(llm):
    """Prompt log-probabilities and the first token's come from the prefill worker, the rest from the
    decode worker; together they are one engine's."""
    prompts, _ = mixed(llm, 6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    expected = llm.generate(prompts, params)
    with DisaggregatedLLM("tiny-py", kv_transport="torch", kv_lease_s=20, start_timeout=120) as pd:
        outputs = pd.generate(prompts, params)
    for got, want in zip(outputs, expected, strict=True):
        assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 8
        for g, w in zip([*got.logprobs, *got.prompt_logprobs[1:]], [*want.logprobs, *want.prompt_logprobs[1:]],
                        strict=True):
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-5 for t in g)


def test_a_transfer_report_that_comes_after_the_last_token_still_lands_in_the_metrics(llm):
    """In push modes the decode worker learns of the written K/V from the transport, and the front end
    from the prefill worker, on another socket: decode tokens may come before that report. They wait for
    it, so every request carries its bytes and timeline: one that runs to its last token, and one that a
    stop string in a decode token ends in the front end (which once finished without its bytes)."""
    prompts, _ = mixed(llm, 8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = tokens(llm.generate(prompts, params))
    # A stop string that the third token's text brings (and the first two's do not): the request ends in decode.
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stopped = [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[third]))
               for p, o in zip(prompts, greedy, strict=True)
               if (third := llm.tokenizer.decode(o.token_ids[2:3])).strip()
               and third not in llm.tokenizer.decode(o.token_ids[:2])]
    assert len(stopped) >= 4, "too few prompts with a usable stop string"
    stop_prompts, stop_params = [p for p, _ in stopped], [sp for _, sp in stopped]
    stop_expected = tokens(llm.generate(stop_prompts, stop_params))
    assert all(reason == "stop" for _, _, reason in stop_expected)
    per_block = 2 * llm.config.num_hidden_layers * 16 * llm.config.num_key_value_heads * llm.config.head_dim * 4
    with DisaggregatedLLM("tiny-py", kv_transport="torch", kv_transfer="push", kv_lease_s=20,
                          start_timeout=120) as pd:
        pd.inject_fault("prefill0", "late_reports")
        for run_prompts, run_params, want in ((prompts, params, expected),
                                              (stop_prompts, stop_params, stop_expected)):
            outputs = pd.generate(run_prompts, run_params)
            assert tokens(outputs) == want
            for o in outputs:
                assert o.metrics.kv_transfer_bytes == -(-len(o.prompt_token_ids) // 16) * per_block, o.request_id
                assert o.metrics.kv_timeline is not None and o.metrics.kv_timeline.transfer is not None
            wait_until_blocks_free(pd)
        # An abort while decode tokens wait for that report ends the request with what it was handed: the
        # kept tokens are dropped (a client that hung up is sent nothing more), and every block comes back.
        rid = pd.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        deltas = pd.engine.watch(rid)
        deadline = time.monotonic() + 20
        while not (pd.core._flights[rid].parked or time.monotonic() > deadline):
            pd.step(timeout=0.01)
        assert pd.core._flights[rid].parked, "no decode token was kept back for the late report"
        handed = [d.token_id for d in deltas if d.token_id is not None]
        assert pd.abort(rid)
        while pd.has_unfinished_requests() and time.monotonic() < deadline:
            pd.step(timeout=0.01)
        after = [d for d in deltas if d.token_id is not None][len(handed):]
        assert after == [] and deltas[-1].finish_reason == "abort", (handed, list(deltas))
        time.sleep(0.4)  # the late report comes now: it must not bring the request back
        pd.step(timeout=0.01)
        assert not pd.has_unfinished_requests() and rid not in pd.engine.processor.states
        wait_until_blocks_free(pd)
