"""The server under load: a storm of streams with clients that hang up, the load generator's numbers against
the server's metrics, arrival schedules, and shutdown on SIGTERM.

- 200 concurrent streams over HTTP, 50 of them dropped by their client at random points, on ``LLM`` and on a
  1P1D ``DisaggregatedLLM``: every survivor equals offline greedy ``LLM.generate`` token for token, each
  dropped request stops within two engine steps of its disconnect, every KV block comes back, and the
  server's event loop is never held up (a lag probe's P99, less the time its thread waited for a core, stays
  under 20 ms).
- ``python -m minipd loadgen`` (its own process) against a live server: its sums equal ``/metrics`` exactly,
  its dispatch lag stays small, and client and server agree on TTFT.
- SIGTERM: requests in flight finish (or are cut at the grace period), the process exits within 5 s and
  leaves no thread or worker process behind.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from pd_helpers import needs_nixl, wait_until_blocks_free
from serve_helpers import ROOT, LoopLagProbe, ServerProcess, keep_states, metric_values, serving

from minipd import LLM, DisaggregatedLLM, SamplingParams
from minipd.pd.messages import Outputs
from minipd.serve.workload import arrival_gaps, synthetic_workload, trace_workload

N, DROPPED = 200, 50


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-py", num_kv_blocks=1024)
    text = ("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser()\n"
            "    args = parser.parse_args(argv)\n    return run(args)\n") * 6
    ids = llm.tokenizer.encode(text)
    prompts = [ids[(i * 7) % 60:(i * 7) % 60 + 3 + (i * 13) % 50] for i in range(N)]
    lengths = [8 + (i * 5) % 24 for i in range(N)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, lengths, [o.token_ids for o in outputs], [o.text for o in outputs]


def run_storm(server, processor, reference, tmp_path, blocks_in_use, made_at=None) -> None:
    """The storm's clients in a process of their own (tests/storm_client.py); the checks on the server's side.

    ``blocks_in_use()`` says how many KV blocks requests still hold (asked right after the storm, while the
    server runs); ``made_at``, when given, has per request when its engine made each of its tokens (a
    disaggregated engine's workers: also those made after the front end had aborted the request, which the
    front end drops)."""
    prompts, lengths, expected, expected_text = reference
    rng = random.Random(0)
    dropped = set(rng.sample(range(N), DROPPED))
    drops = [rng.randint(1, lengths[i] - 4) if i in dropped else 0 for i in range(N)]
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"prompts": prompts, "lengths": lengths, "drops": drops}))
    states = keep_states(processor)
    # When the server handed each abort to the engine (it saw the hang-up and closed the request's stream).
    engine = server.api.engine
    aborted_at: dict[str, float] = {}

    class Noting:  # the engine's command queue, noting when each abort is put in it
        def __init__(self, queue) -> None:
            self.queue = queue

        def put(self, command, *args, **kwargs) -> None:
            if command[0] == "abort":
                aborted_at.setdefault(command[1], time.perf_counter())
            self.queue.put(command, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.queue, name)

    commands = engine._commands
    engine._commands = Noting(commands)
    probe = LoopLagProbe()
    watch = asyncio.run_coroutine_threadsafe(probe.run(), server.loop)
    try:
        clients = subprocess.run([sys.executable, str(ROOT / "tests" / "storm_client.py"), server.url, str(spec),
                                  str(out)], capture_output=True, text=True, timeout=240)
    finally:
        probe.running = False
        watch.result(timeout=5)
        engine._commands = commands
    assert clients.returncode == 0, clients.stderr[-3000:]
    # The hung-up requests' blocks came back at once: asked for right after the storm, with the server still
    # running (a disaggregated engine's lease, longer than this wait, cannot be what frees them).
    deadline = time.monotonic() + 2.0
    while (held := blocks_in_use()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held == 0, f"{held} KV blocks still held 2 s after the storm"
    result = json.loads(out.read_text())
    ids = {int(k): v for k, v in result["ids"].items()}
    texts = {int(k): v for k, v in result["text"].items()}
    dropped_at = {int(k): v for k, v in result["dropped_at"].items()}
    assert set(ids) == set(range(N)) and set(dropped_at) == dropped
    deadline = time.monotonic() + 10  # the last aborts are applied by the engine's thread
    while time.monotonic() < deadline and any(not s.finished for s in states.values()):
        time.sleep(0.02)
    worst, made_after, made_for_ms, taken_after, most_late, still_running = 0, [], [], [], 0, []
    for i in range(N):
        state = states[ids[i]]
        if i in dropped:
            # Tokens after the disconnect: those the front end took in after it and, with workers, those the
            # workers made after it by their own step clocks (a decode worker steps on until the abort reaches
            # it; what it makes then never reaches the request's state).
            # The abort lands within two engine steps of the server handing it over: at most two tokens after.
            if ids[i] in aborted_at:
                late = sum(t > aborted_at[ids[i]] for t in state.metrics.token_times)
                most_late = max(most_late, late)
                # (What a failure needs to be understood: when each token was taken in, from the abort.)
                offsets = [round((t - aborted_at[ids[i]]) * 1e3, 2) for t in state.metrics.token_times]
                route = {k: getattr(state.metrics, k, None) for k in ("prefill_worker", "decode_worker",
                                                                     "kv_transfer_start", "kv_transfer_end")}
                assert late <= 2, (f"request {i} got {late} tokens after the server aborted it: its tokens taken in "
                                   f"at {offsets} ms from the abort, finished {state.finish_reason!r}, {route}, "
                                   f"hung up at {(dropped_at[i] - aborted_at[ids[i]]) * 1e3:.2f} ms")
            after = sum(t > dropped_at[i] for t in state.metrics.token_times)
            taken_after.append(after)
            # Its stream still had more tokens to come than the hang-up allows through: it must end aborted.
            if lengths[i] - (len(state.token_ids) - after) > 4:
                still_running.append(i)
                assert state.finish_reason == "abort", f"request {i} was not aborted ({lengths[i]} tokens asked)"
            assert after <= 4, f"request {i} got {after} tokens after its client hung up"
            if made_at is not None:
                made = [t - dropped_at[i] for t in made_at.get(ids[i], []) if t > dropped_at[i]]
                after = len(made)
                made_after.append(after)
                made_for_ms.append(max(made, default=0.0) * 1e3)
            worst = max(worst, after)
            assert state.finish_reason == "abort" or len(state.token_ids) == lengths[i], i
        else:
            assert state.token_ids == expected[i], f"request {i}"
            # ... and the client received exactly that: the stream's texts joined, then [DONE].
            assert texts[i] == expected_text[i] and result["done"].get(str(i)), f"request {i} as received"
    # Counted from the client's hang-up, the time the server's loop takes to see it counts too: nearly every
    # one took in <= 2 tokens after it; on the shared two cores, one in a storm now and then took in 3.
    assert sum(n > 2 for n in taken_after) <= 2, f"tokens after a hang-up: {collections.Counter(taken_after)}"
    counts = sorted(collections.Counter(made_after).items())
    slowest = sorted(made_for_ms, reverse=True)[:4]
    aborted_hang_ups = sum(states[ids[i]].finish_reason == "abort" for i in dropped)
    print(f"hang-ups with over 4 tokens to come: {len(still_running)} of {DROPPED}; the server aborted "
          f"{sum(ids[i] in aborted_at for i in dropped)}, ended aborted {aborted_hang_ups}; "
          f"most tokens after the server's abort: {most_late}; after a hang-up: {worst}; "
          f"workers' counts (tokens: hang-ups): {counts}; their longest runs on after a hang-up (ms): "
          f"{[round(ms, 1) for ms in slowest]}; {probe.report()}")
    # The workers' own count: the abort reaches a decode worker through the server's event loop, the engine's
    # thread (between two waits for the workers' messages) and a socket, and the worker steps on meanwhile. That
    # is a time, and how many tokens fit in it depends on how fast the worker steps: on the project's two shared
    # cores a worker went on for at most 27 ms after a hang-up (three storms, 150 hang-ups), making 0-2 tokens,
    # one 4 in 16 ms; a storm in a loaded CI run had six make 3-4 (its server's loop stalled up to 33 ms).
    # So: nearly every worker stops within 50 ms of the hang-up, and none makes more than 8 tokens after it.
    assert sum(ms > 50 for ms in made_for_ms) <= 2, f"workers' runs on after a hang-up (ms): {slowest}"
    assert max(made_after, default=0) <= 8, f"workers' tokens after a hang-up: {counts}"
    # Every hang-up with tokens still to come ended aborted (checked above, each); the others had every token
    # made, and on the wire, before their client read far enough to hang up: streams run ahead of a busy client,
    # and how many depends on how fast the clients' process reads against the engine's pace (8 storms each: 7-10
    # of the 50 colocated, 13-25 disaggregated, whose decode worker streams faster). The storm must have put the
    # abort path to work: a fifth of the hang-ups at least, each seen by the server.
    assert len(still_running) >= DROPPED // 5, f"only {len(still_running)} hang-ups had tokens still to come"
    assert all(ids[i] in aborted_at for i in still_running), "an aborted request's abort was not seen by the server"
    # The server's metrics tell the same story (scraped from this engine, colocated or disaggregated).
    metrics = metric_values(httpx.get(f"{server.url}/metrics", timeout=10).text)
    label = (("model_name", "tiny-py"),)
    ours = [states[ids[i]] for i in range(N)]
    aborted = sum(s.finish_reason == "abort" for s in ours)
    assert metrics[("vllm:request_success_total", (("finished_reason", "abort"), *label))] == aborted
    assert metrics[("vllm:request_success_total", (("finished_reason", "length"), *label))] == N - aborted
    assert metrics[("vllm:prompt_tokens_total", label)] == sum(len(p) for p in prompts)
    assert metrics[("vllm:generation_tokens_total", label)] == sum(len(s.token_ids) for s in ours)
    assert metrics[("vllm:num_requests_running", label)] == 0 and metrics[("vllm:num_requests_waiting", label)] == 0
    assert metrics[("vllm:kv_cache_usage_perc", label)] == 0
    # (Latencies are recorded for the requests that ran to their end; an aborted request's are not.)
    assert metrics[("vllm:time_to_first_token_seconds_count", label)] == N - aborted
    assert metrics[("vllm:e2e_request_latency_seconds_count", label)] == N - aborted
    probe.check(0.020)


def test_clients_that_hang_up_stop_their_requests_colocated(reference, tmp_path):
    llm = LLM("tiny-py", num_kv_blocks=1024)
    with serving(llm) as server:
        run_storm(server, llm.engine.processor, reference, tmp_path,
                  blocks_in_use=lambda: llm.engine.block_manager.num_used_blocks)
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


@needs_nixl
def test_clients_that_hang_up_stop_their_requests_disaggregated(reference, tmp_path):
    # A lease far longer than the 2 s the storm's checks wait for the blocks: only the aborts can free them.
    with DisaggregatedLLM("tiny-py", num_kv_blocks=512, kv_lease_s=60, start_timeout=120) as pd:
        made_at: dict[str, list[float]] = {}
        on_message = pd.core._on_message

        def recording(message) -> None:  # (the engine's thread) every token any worker reports, when it was made
            if isinstance(message, Outputs):
                for out in message.outputs.outputs:
                    made_at.setdefault(out.request_id, []).extend([message.outputs.timestamp] * len(out.new_token_ids))
            on_message(message)

        pd.core._on_message = recording

        def blocks_in_use() -> int:
            return sum(s["used_blocks"] for s in pd.worker_stats().values())

        with serving(pd) as server:
            run_storm(server, pd.processor, reference, tmp_path, blocks_in_use, made_at=made_at)
        assert not pd.has_unfinished_requests()
        wait_until_blocks_free(pd, timeout=2)  # every worker let go of every request's blocks


def test_the_load_generator_reconciles_with_the_servers_metrics(tmp_path):
    # One thread for the model: on a two-core machine the server's event loop and the load generator (its own
    # process) then have a core, so what the two clocks measure differs by the HTTP hops, not by waiting turns.
    llm = LLM("tiny-py", num_kv_blocks=512, cpu_threads=1)
    server_ttfts: list[float] = []
    with serving(llm) as server:
        observe = server.api.metrics.observe

        def recording(metrics) -> None:
            server_ttfts.append(metrics.ttft)
            observe(metrics)

        server.api.metrics.observe = recording
        out = tmp_path / "run.json"
        run = subprocess.run([sys.executable, "-m", "minipd", "loadgen", "--url", server.url, "--rate", "20",
                              "--num-requests", "60", "--prompt-len", "16:96", "--output-len", "4:24", "--seed", "3",
                              "--goodput", "ttft:500", "tpot:100", "--warmup", "0", "--output", str(out)],
                             cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                             timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "TTFT" in run.stdout and "request_goodput" in run.stdout
        report = json.loads(out.read_text())
        metrics = metric_values(httpx.get(f"{server.url}/metrics").text)
    label = (("model_name", "tiny-py"),)
    assert report["completed"] == 60 and report["failed"] == 0
    assert metrics[("vllm:prompt_tokens_total", label)] == report["total_input_tokens"]
    assert metrics[("vllm:generation_tokens_total", label)] == report["total_output_tokens"]
    assert report["total_output_tokens"] == sum(report["output_lens"])  # exactly what was planned (ignore_eos)
    assert metrics[("vllm:request_success_total", (("finished_reason", "length"), *label))] == 60
    assert metrics[("vllm:time_to_first_token_seconds_count", label)] == 60
    assert metrics[("vllm:e2e_request_latency_seconds_count", label)] == 60
    assert metrics[("vllm:request_queue_time_seconds_count", label)] == 60
    assert metrics[("vllm:inter_token_latency_seconds_count", label)] == report["total_output_tokens"] - 60
    assert metrics[("vllm:num_requests_running", label)] == 0
    # The schedule was kept, and client and server agree on how long the first token took.
    assert report["p99_dispatch_lag_ms"] <= 5.0, report["p99_dispatch_lag_ms"]
    # The client's clock holds the server's (it starts before the request leaves and stops after the token
    # arrives), so its median cannot be the lower one; the gap is the HTTP hops and the two event loops: a few
    # ms when quiet, 6 ms of 38 seen in CI on two shared cores. A server that timed the wrong span (the whole
    # request, or from admission after a queue) would break one bound or the other.
    client_p50, server_p50 = report["median_ttft_ms"], float(np.median(server_ttfts)) * 1000
    assert client_p50 >= server_p50 - 0.5, (client_p50, server_p50)
    assert client_p50 - server_p50 <= max(15.0, 0.4 * server_p50), (client_p50, server_p50)
    planned = synthetic_workload(60, 20, "16:96", "4:24", seed=3)
    assert report["output_lens"] == [p.output_len for p in planned]
    assert report["input_lens"] == [p.prompt_len for p in planned]


def test_poisson_and_gamma_arrivals_have_their_statistics():
    gaps = arrival_gaps(4000, rate=10.0, seed=1)
    # Kolmogorov-Smirnov against the exponential of mean 0.1 s, at the 1% level (critical value 1.63 / sqrt(n)).
    ordered = np.sort(gaps)
    cdf = 1 - np.exp(-10.0 * ordered)
    n = len(ordered)
    statistic = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert statistic < 1.63 / math.sqrt(n), statistic
    assert abs(gaps.mean() - 0.1) < 0.01
    for burstiness in (0.25, 0.5, 2.0, 4.0):
        g = arrival_gaps(20000, rate=10.0, burstiness=burstiness, seed=2)
        cv = g.std() / g.mean()
        assert abs(cv - 1 / math.sqrt(burstiness)) <= 0.05 / math.sqrt(burstiness), (burstiness, cv)
        assert abs(g.mean() - 0.1) < 0.01
    # The same seed, the same schedule; lengths do not move with the rate.
    a, b = synthetic_workload(50, 5.0, "8:64", "4:16", seed=9), synthetic_workload(50, 5.0, "8:64", "4:16", seed=9)
    assert a == b and [r.prompt_len for r in synthetic_workload(50, 50.0, "8:64", "4:16", seed=9)] == \
        [r.prompt_len for r in a]
    with pytest.raises(ValueError, match="rate"):
        arrival_gaps(3, rate=0)


def test_a_trace_replays_in_arrival_order(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival": 0.5, "prompt_len": 12, "output_len": 4}\n'
                     '{"arrival": 0.0, "prompt": "def f(x):", "output_len": 8}\n\n')
    planned = trace_workload(trace)
    assert [(p.send_at, p.output_len, p.prompt) for p in planned] == [(0.0, 8, "def f(x):"), (0.5, 4, None)]
    trace.write_text('{"arrival": 0.5}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        trace_workload(trace)


def stream_until_cut(url: str, max_tokens: int, logprobs: int | None = None) -> dict:
    """A long stream in a thread; what it got and whether it ended cleanly."""
    result: dict = {"chunks": 0, "done": False, "error": None}

    def run() -> None:
        body = {"prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                **({} if logprobs is None else {"logprobs": logprobs})}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
                for line in response.iter_lines():
                    result["chunks"] += line.startswith("data: {")
                    result["done"] |= line == "data: [DONE]"
        except httpx.HTTPError as err:
            result["error"] = err

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> str:
    """tiny-py with room for 8,192 positions (its rotary embedding has no learned length): answers long enough
    to outlast a grace period on any machine, however fast its steps."""
    import shutil

    folder = tmp_path_factory.mktemp("models") / "tiny-py-8k"
    shutil.copytree(ROOT / "assets" / "models" / "tiny-py", folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


@pytest.mark.parametrize("mode, grace", [
    ("colocated", None),
    pytest.param("disaggregated", 1.5, marks=needs_nixl),
    # (Workers that waited for the interpreter's teardown after serving took 2-3 s more here: 5.5-9.6 s in all.)
    pytest.param("disaggregated", None, marks=needs_nixl),
], ids=["colocated-default-grace", "disaggregated-grace-1.5s", "disaggregated-default-grace"])
def test_sigterm_drains_then_leaves_nothing_behind(mode, grace, long_context_model):
    from minipd.serve.server import GRACE_S

    # Compiled decode off: this is about the drain's timing. (A long-lived server compiles its decode programs in
    # the background, and on 2 cores a program being traced slows every step beside it for seconds: see
    # test_a_served_engine_compiles_in_the_background_answers_meanwhile_and_stops_promptly.)
    args = ["--model", long_context_model, "--option", "num_kv_blocks=2400", "--option", "compile_decode=false"] + (
        [] if grace is None else ["--grace", str(grace)])
    if mode == "disaggregated":
        args += ["--prefill-workers", "1", "--decode-workers", "1", "--option", "kv_lease_s=10"]
    with ServerProcess(*args) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        short = stream_until_cut(server.url, 40)  # finishes within the grace period
        # These do not: 6,000 tokens each, six at once (all of them fit the pool: none waits), each token with its
        # top-5 log-probabilities. (With tiny-py's 1,000 tokens, six at once, one finished inside the 3 s grace
        # period on a quiet machine: the steps of 7 rows took ~3 ms. Here 6,000 steps at 1 ms would still take 6 s.)
        longs = [stream_until_cut(server.url, 6000, logprobs=5) for _ in range(6)]
        deadline = time.monotonic() + 60
        while short["chunks"] < 2 or any(long["chunks"] < 2 for long in longs):
            assert time.monotonic() < deadline, f"the streams did not start in 60 s: {short}, {longs}, {server.lines}"
            time.sleep(0.01)
        children = server.children()
        assert (len(children) >= 2) == (mode == "disaggregated"), children  # the workers, when there are some
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=10)
        took = time.monotonic() - start
        print(f"SIGTERM ({mode}, grace {grace or GRACE_S} s): gone in {took:.2f} s")
        for stream in (short, *longs):
            stream["thread"].join(5)
        assert took <= 5.0, f"SIGTERM took {took:.1f} s (grace {grace or GRACE_S} s)"
        assert server.proc.returncode == 0, server.lines
        assert short["done"] and short["chunks"] >= 40  # drained: it finished
        assert not any(long["done"] for long in longs), longs  # cut at the grace period
        assert took >= (grace or GRACE_S) - 0.2, took  # ... and not before it
        assert "minipd: stopped" in server.lines[-1]
        deadline = time.monotonic() + 3
        while server.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.children() == [], "worker processes outlived the server"


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_served_engine_compiles_in_the_background_answers_meanwhile_and_stops_promptly(mode):
    # The server's engine is long-lived: compile_decode="auto" compiles its decode programs in the background
    # (disaggregated: in the decode worker) while requests are answered eagerly, and SIGTERM still ends the
    # process promptly mid-compilation, leaving nothing behind (no process, no leaked semaphore).
    from minipd import LLM, SamplingParams

    prompt, n = "def fib(n):", 24
    want = LLM("tiny-py").generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text
    extra = ["--prefill-workers", "1", "--kv-transport", "torch"] if mode == "disaggregated" else []
    with ServerProcess("--option", "num_kv_blocks=256", *extra) as server:
        said = [line for line in server.lines if "compiled decode steps:" in line]
        assert said and "compiling in the background; auto: a long-lived engine" in said[0], server.lines
        body = {"model": "tiny-py", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == want
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=10)
        took = time.monotonic() - start
        print(f"SIGTERM while compiling ({mode}): gone in {took:.2f} s")
        assert server.proc.returncode == 0 and took <= 5.0, (took, server.lines[-3:])
        deadline = time.monotonic() + 3
        while server.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.children() == [], "worker processes outlived the server"
        time.sleep(0.5)  # (a leak warning comes from the resource tracker, after the server's last line)
        assert not any("leaked" in line for line in server.lines), server.lines[-5:]
