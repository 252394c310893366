"""``python -m minipd loadgen``: load-test an OpenAI-compatible server and report what its users would see.

Requests go to ``/v1/completions`` as streams (over aiohttp) (with ``ignore_eos``, so every request produces exactly the
output length planned, and ``include_usage``, so token counts are the server's, never re-tokenised) on a
seeded schedule (:mod:`minipd.serve.workload`): open loop at ``--rate`` (Poisson or gamma arrivals, or a
trace, replayed as recorded or scaled to ``--rate``), or closed loop with ``--concurrency`` users each sending
the next request when the last ends. Prompts are synthetic token ids of ``--prompt-len`` tokens (drawn at random
from the server's tokens of :data:`BASE_TEXT`, new ones every run, so that no run is served from the prefix cache
an earlier run filled), or real text from ``--prompts FILE`` (one per line, or JSONL with ``{"prompt": ...}``).

Per request: time to first token (TTFT), time per output token after the first (TPOT), the gaps between
streamed chunks (ITL), end-to-end latency (E2EL), and when it was meant to be sent against when it was
(``intended_send_times``, ``actual_send_times``: the dispatch lag). Summaries use the keys of vLLM's
``benchmark_serving`` JSON (``request_rate``, ``max_concurrency``, ``num_prompts``, ``model_id``,
``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``, ...). Two goodputs, not to be confused:

- ``request_goodput`` (vLLM's): completed requests per second that met every SLO, at the rate offered;
- DistServe's goodput (:func:`search_goodput`): the highest offered rate at which at least 90% of
  requests meet the SLOs, found by bisection over runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from minipd.serve.workload import (
    PlannedRequest,
    at_rate,
    prompt_ids,
    prompts_workload,
    synthetic_workload,
    trace_rate,
    trace_workload,
)

#: Text the server tokenises once; synthetic prompts are drawn from its tokens.
BASE_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
             "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n") * 8


@dataclass
class RequestResult:
    """What one request of a load test saw (times in seconds; ``intended`` and ``sent`` from the test's start)."""

    intended: float
    sent: float = 0.0
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 with one token)."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds (None: not part of the goal)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met(self, r: RequestResult) -> bool:
        """Whether a request met every objective set."""
        return r.ok and all(limit is None or value * 1000 <= limit for limit, value in
                            ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2el_ms, r.e2el)))

    @classmethod
    def parse(cls, items: Sequence[str]) -> Slo:
        """``["ttft:200", "tpot:50"]`` (vLLM's ``--goodput`` form, milliseconds)."""
        values: dict[str, float] = {}
        for item in items:
            name, _, number = item.partition(":")
            if name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"an SLO is ttft:MS, tpot:MS or e2el:MS, got {item!r}")
            values[f"{name}_ms"] = float(number)
        return cls(**values)


async def _one(session: Any, url: str, model: str, item: PlannedRequest, prompt: list[int] | str,
               start: float, result: RequestResult) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": item.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result.sent = sent - start
    last = sent
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            async for raw in response.content:  # one server-sent-event line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = result.output_tokens > 0
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - sent
                    else:
                        result.itls.append(now - last)
                    last = now
            result.e2el = time.perf_counter() - sent
    except Exception as err:  # a failed request is a result, not the end of the test
        result.error = f"{type(err).__name__}: {err}"


#: How long before a send time :func:`_until` stops sleeping and yields instead: the event loop's timers wake up
#: to a millisecond late (epoll rounds its timeout up to whole milliseconds).
SPIN_S = 0.0015


async def _until(deadline: float) -> None:
    """Return at ``deadline`` (``time.perf_counter()``), not a millisecond after: sleep to just before it, then yield
    to the event loop (other requests' work goes on) until it comes."""
    delay = deadline - time.perf_counter() - SPIN_S
    if delay > 0:
        await asyncio.sleep(delay)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


async def server_model(url: str, timeout: float = 30.0) -> str:
    """The first model the server at ``url`` lists (``GET /v1/models``)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        async with client.get(f"{url}/v1/models") as response:
            return (await response.json())["data"][0]["id"]


async def run_load(url: str, workload: Sequence[PlannedRequest], model: str | None = None,
                   concurrency: int | None = None, timeout: float = 300.0, progress: bool = True,
                   warmup: int = 1, prompt_seed: int | None = None) -> list[RequestResult]:
    """Send ``workload`` to the server at ``url``: at each request's ``send_at`` (open loop), or, with
    ``concurrency``, that many at a time back to back (closed loop). Returns one result per request.
    ``warmup`` requests are sent first and not counted (a fresh server's first steps pay one-time costs).

    Requests without their own text get tokens drawn at random from the server's tokens of :data:`BASE_TEXT`
    (:func:`prompt_ids`), seeded by ``prompt_seed``; by default a new seed each call, so that no run finds its
    prompts in the server's prefix cache, left there by an earlier run (a rate sweep, a goodput search's probes,
    a retry)."""
    # aiohttp rather than httpx: measured here, httpx's streaming added about 4 ms to every time to first token.
    import aiohttp
    from tqdm.auto import tqdm

    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: the schedule, not the pool, sets the load
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        if model is None:
            model = await server_model(url)
        async with client.post(f"{url}/tokenize", json={"prompt": BASE_TEXT}) as response:
            base = (await response.json())["tokens"]
        salt = secrets.randbits(64) if prompt_seed is None else prompt_seed
        prompts = [item.prompt if item.prompt is not None else prompt_ids(base, item.prompt_len, i, salt)
                   for i, item in enumerate(workload)]
        for i in range(warmup):  # (indices no request of the run has)
            await _one(client, url, model, PlannedRequest(0.0, 16, 4), prompt_ids(base, 16, (1 << 40) + i, salt), 0.0,
                       RequestResult(intended=0.0))
        results = [RequestResult(intended=item.send_at) for item in workload]
        bar = tqdm(total=len(workload), desc="requests", disable=not progress, leave=False)
        start = time.perf_counter()

        async def send(i: int) -> None:
            await _one(client, url, model, workload[i], prompts[i], start, results[i])
            bar.update(1)

        if concurrency:
            queue = list(range(len(workload)))[::-1]

            async def user() -> None:
                while queue:
                    i = queue.pop()
                    results[i].intended = time.perf_counter() - start
                    await send(i)

            await asyncio.gather(*(user() for _ in range(concurrency)))
        else:
            tasks = []
            for i, item in enumerate(workload):
                await _until(start + item.send_at)
                tasks.append(asyncio.create_task(send(i)))
            await asyncio.gather(*tasks)
        bar.close()
    return results


def _stats(values: list[float], name: str, scale: float = 1000.0) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) * scale if values else np.zeros(1)
    return {f"mean_{name}": float(arr.mean()), f"median_{name}": float(np.median(arr)),
            f"std_{name}": float(arr.std()), f"p90_{name}": float(np.percentile(arr, 90)),
            f"p99_{name}": float(np.percentile(arr, 99))}


#: ``goodput_fn(results, slo, duration_s) -> requests/s``: how :func:`summarize` computes ``request_goodput``.
GoodputFn = Callable[[Sequence[RequestResult], Slo, float], float]


def default_request_goodput(results: Sequence[RequestResult], slo: Slo, duration: float) -> float:
    """vLLM's ``request_goodput``: completed requests that met every objective of ``slo``, per second of the run."""
    return sum(slo.met(r) for r in results) / duration  # (a failed request meets nothing)


def latency_goodput(fn: Callable[[list[float], list[float], float, float, float], float]) -> GoodputFn:
    """A :data:`GoodputFn` from a function of per-request latencies, ``fn(ttfts_ms, tpots_ms, duration_s,
    ttft_slo_ms, tpot_slo_ms)`` (chapter 08's exercise): it is given the completed requests' TTFT and TPOT in
    ms, an objective not set as ``inf``. An ``e2el`` objective cannot be passed on, so it is refused."""

    def goodput(results: Sequence[RequestResult], slo: Slo, duration: float) -> float:
        if slo.e2el_ms is not None:
            raise ValueError("a goodput function of TTFT and TPOT cannot judge an e2el SLO")
        done = [r for r in results if r.ok]
        return fn([r.ttft * 1000 for r in done], [r.tpot * 1000 for r in done], duration,
                  math.inf if slo.ttft_ms is None else slo.ttft_ms, math.inf if slo.tpot_ms is None else slo.tpot_ms)

    return goodput


def summarize(results: Sequence[RequestResult], slo: Slo | None = None,
              goodput_fn: GoodputFn | None = None) -> dict[str, Any]:
    """The run in vLLM's benchmark keys (times in ms), with SLO attainment and the dispatch lag.

    ``request_goodput`` is ``goodput_fn(results, slo, duration_s)`` (default :func:`default_request_goodput`;
    :func:`latency_goodput` adapts a function of TTFT/TPOT lists), None without ``slo``. Per request, in the
    order of ``results``: ``input_lens``, ``output_lens``, ``errors`` ("" when it succeeded), ``ttfts``, ``tpots``,
    ``e2els`` (seconds: what the SLOs are judged on), ``itls`` (a list each), and ``intended_send_times`` and
    ``actual_send_times`` (seconds from the run's start; their differences are the dispatch lags the
    ``*_dispatch_lag_ms`` keys summarise)."""
    done = [r for r in results if r.ok]
    duration = max((r.sent + r.e2el for r in done), default=0.0) - min((r.sent for r in results), default=0.0)
    duration = max(duration, 1e-9)
    inputs, outputs = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    lags = [r.sent - r.intended for r in results]
    goodput = None if slo is None else float((goodput_fn or default_request_goodput)(results, slo, duration))
    summary: dict[str, Any] = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(done) / duration, "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "request_goodput": goodput,
        "slo_attainment": attainment_share(results, slo) if slo else len(done) / max(len(results), 1),
        **_stats([r.ttft for r in done], "ttft_ms"), **_stats([r.tpot for r in done if r.output_tokens > 1], "tpot_ms"),
        **_stats([x for r in done for x in r.itls], "itl_ms"), **_stats([r.e2el for r in done], "e2el_ms"),
        **_stats(lags, "dispatch_lag_ms"),
        "input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itls for r in results],
        "tpots": [r.tpot for r in results], "e2els": [r.e2el for r in results],  # seconds, as Slo.met judges them
        "errors": [r.error for r in results],
        "intended_send_times": [r.intended for r in results], "actual_send_times": [r.sent for r in results],
    }
    return summary


def attainment_share(results: Sequence[RequestResult], slo: Slo) -> float:
    """Share of ``results`` that met every objective of ``slo`` (a failed request counts as missed)."""
    return sum(slo.met(r) for r in results) / max(len(results), 1)


def meets(run_at: Callable[[float], Sequence[RequestResult]], rate: float, slo: Slo, attainment: float,
          tried: list[tuple[float, float]]) -> bool:
    """Run at ``rate``; note (rate, share of requests meeting ``slo``) in ``tried``; whether the share reaches
    ``attainment``."""
    share = attainment_share(run_at(rate), slo)
    tried.append((rate, share))
    return share >= attainment


def search_goodput(run_at: Callable[[float], Sequence[RequestResult]], slo: Slo, low: float, high: float,
                   attainment: float = 0.9, iterations: int = 5) -> tuple[float, list[tuple[float, float]]]:
    """DistServe's goodput: the highest rate (requests/s) in ``[low, high]`` at which at least ``attainment`` of
    requests meet ``slo``, by bisection over runs (``run_at(rate)`` runs one). Returns it (0 when even ``low``
    fails) and every (rate, attainment) tried."""
    tried: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        return meets(run_at, rate, slo, attainment, tried)

    if not ok(low):
        return 0.0, tried
    if ok(high):
        return high, tried
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low, tried


def format_summary(summary: dict[str, Any]) -> str:
    """A table of the summary for people."""
    lines = [f"completed {summary['completed']} (failed {summary['failed']}) in {summary['duration']:.2f} s: "
             f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s"]
    if summary.get("request_goodput") is not None:
        lines.append(f"request_goodput {summary['request_goodput']:.2f} req/s "
                     f"(SLO attainment {summary['slo_attainment']:.0%})")
    lines.append(f"{'ms':>8} {'mean':>9} {'median':>9} {'p90':>9} {'p99':>9}")
    for name in ("ttft", "tpot", "itl", "e2el", "dispatch_lag"):
        lines.append(f"{name.upper():>8} " + " ".join(f"{summary[f'{k}_{name}_ms']:9.2f}"
                                                        for k in ("mean", "median", "p90", "p99")))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipd loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="requests/s, open loop (default 4; inf: all at once)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: this many users back to back")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--prompt-len", default="128", help="tokens: N, LOW:HIGH (uniform), normal:MEAN:STD[:MAX] or "
                        "lognormal:MEAN:SIGMA[:MAX] (default 128)")
    parser.add_argument("--output-len", default="32", help="tokens, as --prompt-len (default 32)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", default=None,
                        help="JSONL: arrival, prompt_len (or prompt), output_len per line; with --rate or "
                             "--search-goodput its times are scaled to the rate (its shape kept)")
    source.add_argument("--prompts", default=None, metavar="FILE",
                        help="real prompts: one per line, or JSONL with {\"prompt\": ...} (output lengths from "
                             "--output-len, send times from --rate/--burstiness)")
    parser.add_argument("--prompts-order", choices=("random", "cycle"), default="random",
                        help="with --prompts: pick at random (seeded, default) or take them in file order, cycling")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the schedule (arrivals, lengths, picks from --prompts); synthetic prompts' "
                             "tokens are new every run")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="ttft:MS",
                        help="SLOs (ttft:MS tpot:MS e2el:MS) for request_goodput and attainment")
    parser.add_argument("--search-goodput", nargs=2, type=float, default=None, metavar=("LOW", "HIGH"),
                        help="find DistServe's goodput: the highest rate in [LOW, HIGH] with >= 90%% attainment")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take (default 300)")
    parser.add_argument("--output", default=None, help="write the JSON summary here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``loadgen`` command."""
    args = build_parser().parse_args(argv)
    slo = Slo.parse(args.goodput) if args.goodput else None

    if args.search_goodput:
        if slo is None:
            raise ValueError("--search-goodput needs SLOs: --goodput ttft:MS tpot:MS")
        if args.concurrency:
            raise ValueError("--search-goodput bisects over the offered rate, which a closed loop "
                             "(--concurrency) does not set: drop --concurrency")
        if args.rate is not None:
            raise ValueError("--search-goodput chooses the rates itself (between LOW and HIGH): drop --rate")
    trace = trace_workload(args.trace) if args.trace else None

    def plan(rate: float) -> list[PlannedRequest]:
        if trace is not None:  # replayed as recorded, or scaled to the rate asked for (--rate, --search-goodput)
            return trace if args.rate is None and not args.search_goodput else at_rate(trace, rate)
        if args.prompts:
            return prompts_workload(args.prompts, args.num_requests, rate, args.output_len, args.burstiness,
                                    args.seed, args.prompts_order)
        return synthetic_workload(args.num_requests, rate, args.prompt_len, args.output_len, args.burstiness,
                                  args.seed)

    model = args.model or asyncio.run(server_model(args.url, min(args.timeout, 30.0)))

    def run_at(rate: float) -> list[RequestResult]:
        return asyncio.run(run_load(args.url, plan(rate), model, args.concurrency, args.timeout,
                                    warmup=args.warmup))

    # vLLM's benchmark_serving keys (request_rate, max_concurrency, num_prompts, model_id, ...); the names this
    # report had first (rate, concurrency) are kept as aliases.
    about: dict[str, Any] = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "minipd",
                             "model_id": model, "burstiness": args.burstiness, "seed": args.seed,
                             "max_concurrency": args.concurrency, "concurrency": args.concurrency,
                             "slo": asdict(slo) if slo else None}
    if args.search_goodput:
        best, tried = search_goodput(run_at, slo, *args.search_goodput)
        report: dict[str, Any] = {"goodput": best, "tried": tried, **about, "request_rate": None, "rate": None,
                                  "num_prompts": len(plan(args.search_goodput[0]))}
        print(f"goodput (DistServe): {best:.2f} req/s with >= 90% of requests within {asdict(slo)}")
        for rate, share in tried:
            print(f"  {rate:7.2f} req/s: {share:.0%} met the SLOs")
    else:
        rate = args.rate if args.rate is not None else (math.inf if args.concurrency else 4.0)
        if trace is not None and args.rate is None and not args.concurrency:
            rate = trace_rate(trace)  # the trace's own
        results = run_at(rate)
        report = summarize(results, slo)
        request_rate = rate if math.isfinite(rate) else "inf"  # (as vLLM writes it: JSON has no infinity)
        report.update(about, num_prompts=len(results), request_rate=request_rate, rate=request_rate)
        print(format_summary(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, allow_nan=False)
    return 0


__all__ = ["GoodputFn", "RequestResult", "Slo", "attainment_share", "default_request_goodput", "format_summary",
           "latency_goodput", "meets", "run_load", "search_goodput", "server_model", "summarize"]
