"""The load generator on its own: prompts files, the JSON report (vLLM's keys, intended against actual send
times), the goodput search's refusals, a pluggable request goodput, and its schedule kept at 50 req/s against a
fake server that answers at once (so what is measured is the load generator's dispatching, not an engine).

The fake server (aiohttp, in a process of its own on 127.0.0.1) streams ``max_tokens`` one-character chunks, then
a usage chunk whose ``prompt_tokens`` is the prompt's length (characters for text, ids for token lists), then
``[DONE]``; it is killed on the way out, whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from minipd.serve import loadgen
from minipd.serve.loadgen import RequestResult, Slo, latency_goodput, main, summarize
from minipd.serve.workload import (
    PlannedRequest,
    at_rate,
    draw_lengths,
    prompt_ids,
    prompts_workload,
    read_prompts,
    synthetic_workload,
    trace_rate,
)

FAKE_SERVER = textwrap.dedent('''
    import asyncio, json, sys
    from aiohttp import web

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def tokenize(request):
        return web.json_response({"tokens": list(range(1, 65))})

    async def completions(request):
        body = await request.json()
        prompt = body["prompt"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "total_tokens": len(prompt) + body["max_tokens"]}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\n".encode())
        await response.write(b"data: [DONE]\\n\\n")
        await response.write_eof()
        return response

    async def serve():
        app = web.Application()
        app.add_routes([web.get("/v1/models", models), web.post("/tokenize", tokenize),
                        web.post("/v1/completions", completions)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print("port", site._server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())
''')


@pytest.fixture(scope="module")
def fake_url():
    """A fake OpenAI-compatible server in its own process; its URL. Always killed afterwards."""
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints its port once it listens (or exits: an empty line)
        if not line.startswith("port "):
            proc.kill()
            raise RuntimeError(f"the fake server did not start: {line!r} {proc.communicate(timeout=10)[1][-2000:]}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def run_cli(url: str, tmp_path, *args: str) -> dict:
    """``loadgen`` against ``url`` (bounded: every request within 20 s); its JSON report."""
    out = tmp_path / "report.json"
    assert main(["--url", url, "--warmup", "0", "--timeout", "20", "--output", str(out), *args]) == 0
    return json.loads(out.read_text())


# G14: a prompts file.

def test_a_prompts_file_is_read_as_lines_or_jsonl(tmp_path):
    lines = tmp_path / "prompts.txt"
    lines.write_text("def f(x):\n\nclass Stack:\nimport os\n")
    assert read_prompts(lines) == ["def f(x):", "class Stack:", "import os"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "def f(x):\n    return x"}) + "\n" + json.dumps({"prompt": "b = 2"}) + "\n")
    assert read_prompts(jsonl) == ["def f(x):\n    return x", "b = 2"]  # newlines inside a prompt survive
    jsonl.write_text(json.dumps({"prompt": "a"}) + "\nnot json\n")
    with pytest.raises(ValueError, match="prompt 2"):
        read_prompts(jsonl)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(tmp_path / "empty.txt")


def test_prompts_are_chosen_by_seed_or_cycled_on_the_synthetic_schedule():
    texts = ["aa", "bbbb", "c", "ddddddd"]
    a = prompts_workload(texts, 40, 10.0, "3:9", seed=5)
    assert a == prompts_workload(texts, 40, 10.0, "3:9", seed=5)  # same seed, same requests
    assert [r.prompt for r in a] != [r.prompt for r in prompts_workload(texts, 40, 10.0, "3:9", seed=6)]
    assert {r.prompt for r in a} == set(texts) and all(r.prompt_len == len(r.prompt) for r in a)
    assert all(3 <= r.output_len <= 9 for r in a)
    assert [r.send_at for r in a] == [r.send_at for r in synthetic_workload(40, 10.0, seed=5)]
    cycled = prompts_workload(texts, 6, 10.0, 4, order="cycle")
    assert [r.prompt for r in cycled] == texts + texts[:2] and {r.output_len for r in cycled} == {4}
    with pytest.raises(ValueError, match="random or cycle"):
        prompts_workload(texts, 6, 10.0, 4, order="sorted")


def test_synthetic_prompts_share_no_prefix_block_within_or_across_runs():
    base = list(range(1, 65))  # a text's tokens, as the fake server gives them
    assert prompt_ids(base, 40, 3, salt=7) == prompt_ids(base, 40, 3, salt=7)  # reproducible
    assert len(prompt_ids(base, 40, 3)) == 40 and set(prompt_ids(base, 400, 3)) <= set(base)
    # Cutting prompts out of a periodic text gave 66 distinct prompts, shared run after run: none now.
    blocks = [tuple(prompt_ids(base, 16, i, salt)) for salt in (0, 1) for i in range(500)]
    assert len(set(blocks)) == len(blocks)
    with pytest.raises(ValueError, match="no tokens"):
        prompt_ids([], 4, 0)


def test_each_run_of_the_load_generator_sends_prompts_no_earlier_run_sent(fake_url, monkeypatch):
    sent: list[list[int]] = []
    one = loadgen._one

    async def recording(client, url, model, item, prompt, start, result):
        sent.append(list(prompt))
        await one(client, url, model, item, prompt, start, result)

    monkeypatch.setattr(loadgen, "_one", recording)
    plan = synthetic_workload(6, 500.0, 32, 2, seed=0)
    runs = []
    for seed in (None, None, 5, 5):
        sent.clear()
        results = asyncio.run(loadgen.run_load(fake_url, plan, "fake", timeout=20, progress=False, warmup=1,
                                               prompt_seed=seed))
        assert all(r.ok for r in results)
        runs.append([tuple(p[:16]) for p in sent])
    first_blocks = [set(run) for run in runs]
    assert not first_blocks[0] & first_blocks[1]  # two default runs: fresh prompts (warm-up included)
    assert runs[2] == runs[3] and not first_blocks[2] & (first_blocks[0] | first_blocks[1])  # a fixed seed repeats
    assert len(first_blocks[0]) == 7  # six requests and a warm-up, all different


def test_the_command_sends_the_prompts_of_a_file(fake_url, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def f(x):", "import numpy as np", "class A:\n    pass"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    report = run_cli(fake_url, tmp_path, "--prompts", str(prompts), "--prompts-order", "cycle", "--rate", "200",
                     "--num-requests", "5", "--output-len", "3")
    assert report["completed"] == 5
    assert report["input_lens"] == [len(texts[i % 3]) for i in range(5)]  # the fake server counts the characters
    assert report["output_lens"] == [3] * 5


def test_lengths_can_be_normal_or_lognormal_and_uniform_ones_do_not_move():
    rng = np.random.default_rng(4)
    normal = draw_lengths("normal:200:40", 20000, rng)
    assert abs(normal.mean() - 200) < 2 and abs(normal.std() - 40) < 2 and normal.min() >= 1
    heavy = draw_lengths("lognormal:300:1.0", 20000, rng)
    assert abs(heavy.mean() / 300 - 1) < 0.05 and abs(np.median(heavy) / (300 * math.exp(-0.5)) - 1) < 0.05
    capped = draw_lengths("lognormal:300:1.0:512", 20000, rng)
    assert capped.max() == 512 and capped.min() >= 1
    assert draw_lengths("normal:3:50", 1000, rng).min() == 1  # at least one token
    for bad in ("normal:200", "lognormal:0:1", "normal:200:-1", "normal:a:b", "lognormal:300:1:0"):
        with pytest.raises(ValueError, match="prompt_lens"):
            synthetic_workload(4, 1.0, bad)
    # Fixed and uniform lengths are drawn as before: the simulator's stored studies keep their workloads.
    rng = np.random.default_rng(10)
    prompts, outputs = rng.integers(8, 65, 50), rng.integers(4, 17, 50)
    planned = synthetic_workload(50, 5.0, "8:64", "4:16", seed=9)
    assert [r.prompt_len for r in planned] == list(prompts) and [r.output_len for r in planned] == list(outputs)
    mixed = synthetic_workload(50, 5.0, "lognormal:64:0.5", 8, seed=9)
    assert [r.send_at for r in mixed] == [r.send_at for r in planned] and {r.output_len for r in mixed} == {8}


# G15 and G16: the report.

def test_the_summary_records_intended_and_actual_send_times():
    rng = np.random.default_rng(0)
    intended = np.cumsum(rng.exponential(0.02, 200))
    sent = intended + rng.exponential(0.001, 200)
    results = [RequestResult(intended=float(i), sent=float(s), ok=True, output_tokens=3, ttft=0.01, e2el=0.03)
               for i, s in zip(intended, sent, strict=True)]
    summary = summarize(results)
    assert summary["intended_send_times"] == list(intended) and summary["actual_send_times"] == list(sent)
    lags = (np.array(summary["actual_send_times"]) - np.array(summary["intended_send_times"])) * 1000
    for key, value in (("mean", lags.mean()), ("median", np.median(lags)), ("p90", np.percentile(lags, 90)),
                       ("p99", np.percentile(lags, 99))):
        assert math.isclose(summary[f"{key}_dispatch_lag_ms"], value, rel_tol=1e-9), key


def test_the_report_has_vllms_keys_and_keeps_the_old_ones(fake_url, tmp_path):
    report = run_cli(fake_url, tmp_path, "--rate", "100", "--num-requests", "8", "--prompt-len", "4",
                     "--output-len", "2", "--goodput", "ttft:1000")
    assert report["request_rate"] == 100.0 and report["max_concurrency"] is None
    assert report["num_prompts"] == 8 and report["model_id"] == "fake-model" and report["backend"] == "minipd"
    assert report["rate"] == 100.0 and report["concurrency"] is None and report["burstiness"] == 1.0  # aliases
    assert len(report["intended_send_times"]) == len(report["actual_send_times"]) == 8
    assert report["intended_send_times"] == [r.send_at for r in synthetic_workload(8, 100.0, 4, 2)]
    closed = run_cli(fake_url, tmp_path, "--concurrency", "3", "--num-requests", "6", "--prompt-len", "4",
                     "--output-len", "2", "--model", "fake-model")
    assert closed["request_rate"] == "inf" and closed["max_concurrency"] == 3 and closed["num_prompts"] == 6


def test_a_trace_with_a_rate_is_replayed_at_that_rate(fake_url, tmp_path):
    planned = [PlannedRequest(t, 4, 2) for t in (0.0, 1.0, 4.0)]  # a lull after a burst: 0.5 req/s on average
    assert trace_rate(planned) == 0.5 and trace_rate(planned[:1]) == math.inf
    assert [r.send_at for r in at_rate(planned, 2.0)] == [0.0, 0.25, 1.0]  # the same shape, 4x as fast
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival": t, "prompt_len": 4, "output_len": 2}) + "\n" for t in (0, 1, 4)))
    report = run_cli(fake_url, tmp_path, "--trace", str(trace), "--rate", "20")
    assert report["intended_send_times"] == pytest.approx([0.0, 0.025, 0.1]) and report["request_rate"] == 20.0
    assert run_cli(fake_url, tmp_path, "--trace", str(trace))["intended_send_times"] == [0.0, 1.0, 4.0]  # as is


def test_the_goodput_search_refuses_a_closed_loop_and_scales_a_trace(tmp_path, monkeypatch):
    args = ["--url", "http://127.0.0.1:9", "--model", "m", "--goodput", "ttft:100", "--search-goodput", "1", "4"]
    with pytest.raises(ValueError, match="--concurrency"):
        main([*args, "--concurrency", "2"])
    with pytest.raises(ValueError, match="--rate"):
        main([*args, "--rate", "2"])
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival": t, "prompt_len": 4, "output_len": 2}) + "\n" for t in (0, 1, 2)))
    offered: list[float] = []

    async def fake_run_load(url, workload, model, concurrency, timeout, warmup):
        offered.append(trace_rate(workload))  # the rate each run of the bisection really offered
        ok = offered[-1] <= 2.6  # meets the SLO up to 2.6 req/s
        return [RequestResult(intended=0.0, ok=True, output_tokens=2, ttft=0.05 if ok else 1.0, e2el=1.0)
                for _ in workload]

    monkeypatch.setattr(loadgen, "run_load", fake_run_load)
    out = tmp_path / "search.json"
    assert main([*args, "--trace", str(trace), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [round(r, 6) for r in offered] == [round(rate, 6) for rate, _ in report["tried"]]
    assert 2.5 <= report["goodput"] <= 2.6 and report["num_prompts"] == 3


# G17: the schedule is kept at 50 req/s.

BARE_TIMER = textwrap.dedent('''
    import asyncio, sys, time
    import numpy as np
    from minipd.serve.loadgen import _until
    from minipd.serve.workload import synthetic_workload

    async def probe():
        start, lags = time.perf_counter(), []
        for item in synthetic_workload(int(sys.argv[2]), float(sys.argv[1]), seed=int(sys.argv[3])):
            await _until(start + item.send_at)
            lags.append(time.perf_counter() - start - item.send_at)
        print(np.percentile(lags, 99) * 1000)

    asyncio.run(probe())
''')


def test_the_dispatch_lag_stays_small_at_50_requests_per_second(fake_url, tmp_path):
    # Up to three runs of 160 requests (about 3 s each). Beside each, in a process of its own, a bare asyncio timer
    # keeps the same schedule with no HTTP at all: the machine's own share of any lag at that moment. The bound is
    # P99 <= 5 ms; on a shared machine busy enough that its bare timer's P99 passes 5 ms (other jobs holding the
    # cores for ms at a time), the load generator must stay within 2 ms of it, and a warning says so.
    tries = []
    for attempt in range(3):
        seed = 11 + attempt
        bare = subprocess.Popen([sys.executable, "-c", BARE_TIMER, "50", "160", str(seed)], stdout=subprocess.PIPE,
                                text=True)
        try:
            report = run_cli(fake_url, tmp_path, "--rate", "50", "--num-requests", "160", "--prompt-len", "4",
                             "--output-len", "2", "--seed", str(seed))
            bare_p99 = float(bare.communicate(timeout=60)[0])
        finally:
            bare.kill()
            bare.wait(timeout=10)
        assert report["completed"] == 160 and report["failed"] == 0, report["errors"][:3]
        lags = (np.array(report["actual_send_times"]) - np.array(report["intended_send_times"])) * 1000
        assert math.isclose(np.percentile(lags, 99), report["p99_dispatch_lag_ms"], rel_tol=1e-9)
        assert math.isclose(np.median(lags), report["median_dispatch_lag_ms"], rel_tol=1e-9)
        assert lags.min() >= 0  # never early
        p99 = report["p99_dispatch_lag_ms"]
        tries.append((round(p99, 2), round(bare_p99, 2)))
        if p99 <= 5.0:
            return
        if bare_p99 > 5.0 and p99 <= bare_p99 + 2.0:
            warnings.warn(f"the 5 ms dispatch-lag bound went unchecked: this machine's own timers lag more "
                          f"(P99 ms, load generator and bare timer, per run: {tries})", stacklevel=1)
            return
    raise AssertionError(f"dispatch lag P99 (ms) per run, with a bare timer's beside it: {tries}")


# G13: a pluggable request goodput.

def test_the_request_goodput_is_pluggable():
    results = [RequestResult(intended=0.0, sent=0.0, ok=True, output_tokens=11, ttft=t / 1000, e2el=(t + 10 * p) / 1000)
               for t, p in [(100, 20), (250, 20), (150, 60), (200, 50)]]
    results.append(RequestResult(intended=0.0, error="HTTP 500"))
    slo = Slo(ttft_ms=200, tpot_ms=50)
    default = summarize(results, slo)
    assert math.isclose(default["request_goodput"], 2 / default["duration"])  # (100, 20) and (200, 50)
    seen = {}

    def reader(ttfts_ms, tpots_ms, duration_s, ttft_slo_ms, tpot_slo_ms):
        seen.update(ttfts=ttfts_ms, slos=(ttft_slo_ms, tpot_slo_ms))
        return sum(a <= ttft_slo_ms and b <= tpot_slo_ms for a, b in zip(ttfts_ms, tpots_ms, strict=True)) / duration_s

    assert summarize(results, slo, goodput_fn=latency_goodput(reader))["request_goodput"] == \
        pytest.approx(default["request_goodput"])
    # The report's per-request lists are enough to recompute it (what chapter 08's checker is fed).
    done = [i for i, error in enumerate(default["errors"]) if not error]
    assert reader([default["ttfts"][i] * 1000 for i in done], [default["tpots"][i] * 1000 for i in done],
                  default["duration"], 200, 50) == pytest.approx(default["request_goodput"])
    assert seen["ttfts"] == pytest.approx([100, 250, 150, 200]) and seen["slos"] == (200, 50)  # failed left out
    summarize(results, Slo(ttft_ms=200), goodput_fn=latency_goodput(reader))
    assert seen["slos"] == (200, math.inf)
    assert summarize(results, slo, goodput_fn=lambda rs, s, d: 7.0)["request_goodput"] == 7.0
    assert summarize(results, goodput_fn=lambda rs, s, d: 7.0)["request_goodput"] is None  # no SLO, no goodput
    with pytest.raises(ValueError, match="e2el"):
        summarize(results, Slo(e2el_ms=500), goodput_fn=latency_goodput(reader))
