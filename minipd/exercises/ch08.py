"""Chapter 08 exercises: the two goodputs of a load test, and an admission rule plugged into the server.

- ``request_goodput``: vLLM's goodput, requests per second that met every SLO at the rate offered;
- ``search_goodput``: DistServe's goodput, the highest rate at which enough requests meet the SLOs, by
  bisection over runs (here over a function that tells the attainment at a rate);
- ``admit``: an admission rule; the checker compares it on fixed loads, then serves ``tiny-py`` with it
  under a burst and checks that the server turned requests away and that every request it admitted got
  exactly the tokens offline greedy ``LLM.generate`` gives.

Each checker prints PASS, FAIL (the first case that differs) or TODO, and never raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from minipd.exercises.checking import Case, CheckResult, call_reader, report
from minipd.serve.app import Load

__all__ = [
    "MAX_QUEUE",
    "check_admit",
    "check_request_goodput",
    "check_search_goodput",
    "loadgen_case",
    "reference_admit",
    "reference_request_goodput",
    "reference_search_goodput",
]

#: The admission rule's limits: requests queued beyond those running, and the KV share above which the
#: server stops admitting.
MAX_QUEUE, MAX_KV_USAGE = 4, 0.95


# --- reference solutions ------------------------------------------------------------------------


def reference_request_goodput(ttfts_ms: list[float], tpots_ms: list[float], duration_s: float,
                              ttft_slo_ms: float, tpot_slo_ms: float) -> float:
    """Requests per second (over the run's ``duration_s``) whose TTFT and TPOT both met their SLO (a value equal
    to its SLO meets it)."""
    met = sum(1 for ttft, tpot in zip(ttfts_ms, tpots_ms, strict=True) if ttft <= ttft_slo_ms and tpot <= tpot_slo_ms)
    return met / duration_s


def reference_search_goodput(attainment_at: Callable[[float], float], low: float, high: float,
                             target: float = 0.9, iterations: int = 6) -> float:
    """The highest rate in ``[low, high]`` with ``attainment_at(rate) >= target``, assuming attainment falls as
    the rate grows: 0 when even ``low`` misses, ``high`` when ``high`` makes it, else ``iterations`` halvings
    of the bracket, returning its lower end (a rate known to meet the target)."""
    if attainment_at(low) < target:
        return 0.0
    if attainment_at(high) >= target:
        return high
    for _ in range(iterations):
        middle = (low + high) / 2
        if attainment_at(middle) >= target:
            low = middle
        else:
            high = middle
    return low


def reference_admit(load: Load) -> bool:
    """Admit while fewer than :data:`MAX_QUEUE` requests wait beyond those running (``in_flight - running``)
    and the KV cache is under :data:`MAX_KV_USAGE` full."""
    return load.in_flight - load.running < MAX_QUEUE and load.kv_usage < MAX_KV_USAGE


# --- checkers -------------------------------------------------------------------------------------


def _goodput_cases() -> list[Case]:
    return [
        Case("all meet", ([100.0, 120.0], [20.0, 25.0], 2.0, 200.0, 50.0)),
        Case("one misses its TTFT", ([100.0, 900.0, 150.0], [20.0, 20.0, 20.0], 3.0, 200.0, 50.0)),
        Case("one misses its TPOT", ([100.0, 120.0, 150.0], [20.0, 80.0, 20.0], 1.5, 200.0, 50.0)),
        Case("equal to the SLO meets it", ([200.0, 200.0], [50.0, 50.0], 4.0, 200.0, 50.0)),
        Case("none meet", ([500.0, 600.0], [20.0, 20.0], 2.0, 200.0, 50.0)),
        Case("no requests", ([], [], 1.0, 200.0, 50.0)),
    ]


def loadgen_case(report: dict, ttft_slo_ms: float = 200.0, tpot_slo_ms: float = 50.0) -> Case:
    """A case from a real load test: the JSON report of ``python -m minipd loadgen --output`` (its per-request
    ``ttfts`` and ``tpots``, the TPOT the load generator judges its SLOs on; failed requests left out). A report
    without ``tpots`` (older) gives TPOT as the mean gap after the first token, from ``itls`` and ``output_lens``."""
    ttfts, tpots = [], []
    given = report.get("tpots") or [None] * len(report["ttfts"])
    for ttft, tpot, itls, out, error in zip(report["ttfts"], given, report["itls"], report["output_lens"],
                                            report["errors"], strict=True):
        if not error:
            ttfts.append(ttft * 1000)
            tpots.append(tpot * 1000 if tpot is not None else (sum(itls) * 1000 / (out - 1) if out > 1 else 0.0))
    rate = report.get("request_rate", "?")
    return Case(f"a load test at {rate} req/s", (ttfts, tpots, report["duration"], ttft_slo_ms, tpot_slo_ms))


def check_request_goodput(fn: Callable[..., float], reports: Sequence[dict] = ()) -> CheckResult:
    """Check ``fn(ttfts_ms, tpots_ms, duration_s, ttft_slo_ms, tpot_slo_ms) -> requests/s`` on synthetic cases,
    then on the measured latencies of each load-test report in ``reports`` (see :func:`loadgen_case`)."""
    name = "request_goodput"
    for index, case in enumerate(_goodput_cases() + [loadgen_case(r) for r in reports]):
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        expected = reference_request_goodput(*case.args)
        if isinstance(actual, bool) or not isinstance(actual, (int, float)) or not math.isclose(
                actual, expected, rel_tol=1e-9, abs_tol=1e-12):
            return report(CheckResult("FAIL", name, f"case {index} ({case.label}): got {actual!r}, expected "
                                                    f"{expected!r}", first_mismatch=index))
    return report(CheckResult("PASS", name))


def _attainment_curves() -> list[tuple[str, Callable[[float], float], float, float]]:
    def falling(knee: float) -> Callable[[float], float]:
        return lambda rate: 1.0 / (1.0 + math.exp((rate - knee) * 1.5))
    return [("a knee at 7 req/s", falling(8.5), 1.0, 16.0), ("a knee at 3 req/s", falling(4.5), 0.5, 20.0),
            ("every rate meets it", lambda rate: 1.0, 1.0, 8.0), ("no rate meets it", lambda rate: 0.5, 1.0, 8.0)]


def check_search_goodput(fn: Callable[..., float]) -> CheckResult:
    """Check ``fn(attainment_at, low, high, target=0.9, iterations=6) -> rate``: the same rate as the reference on
    four attainment curves, found with at most ``iterations + 2`` runs."""
    name = "search_goodput"
    for index, (label, curve, low, high) in enumerate(_attainment_curves()):
        calls: list[float] = []

        def attainment_at(rate: float, curve: Callable[[float], float] = curve, calls: list[float] = calls) -> float:
            calls.append(rate)
            return curve(rate)

        actual, failure = call_reader(name, fn, Case(label, (attainment_at, low, high)))
        if failure is not None:
            return report(failure)
        expected = reference_search_goodput(curve, low, high)
        if isinstance(actual, bool) or not isinstance(actual, (int, float)) or not math.isclose(
                actual, expected, rel_tol=1e-9, abs_tol=1e-9):
            return report(CheckResult("FAIL", name, f"case {index} ({label}, rates {low}-{high}): got {actual!r}, "
                                                    f"expected {expected!r}", first_mismatch=index))
        if len(calls) > 8:
            return report(CheckResult("FAIL", name, f"case {index} ({label}): {len(calls)} runs; a bisection "
                                                    "needs at most iterations + 2 = 8 (each run is a load test)"))
        if actual > 0 and curve(actual) < 0.9:
            return report(CheckResult("FAIL", name, f"case {index}: the rate returned misses the target"))
    return report(CheckResult("PASS", name))


def _loads() -> list[Case]:
    loads = [Load(0, 0, 0, 0.0), Load(3, 0, 3, 0.2), Load(4, 0, 4, 0.2), Load(10, 8, 2, 0.5), Load(12, 8, 4, 0.5),
             Load(6, 6, 0, 0.96), Load(6, 6, 0, 0.95), Load(6, 6, 0, 0.94), Load(9, 4, 5, 0.3)]
    return [Case(repr(load), (load,)) for load in loads]


def check_admit(fn: Callable[[Load], bool], live: bool = True) -> CheckResult:
    """Check ``fn(load) -> bool`` on fixed loads, then (``live``) as the admission rule of a ``tiny-py`` server
    hit by a burst of 24 requests."""
    name = "admit"
    for index, case in enumerate(_loads()):
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        expected = reference_admit(*case.args)
        if not isinstance(actual, bool) or actual != expected:
            return report(CheckResult("FAIL", name, f"for {case.label}: got {actual!r}, expected {expected!r}",
                                      first_mismatch=index))
    return report(_check_admit_live(name, fn) if live else CheckResult("PASS", name))


def _check_admit_live(name: str, fn: Callable[[Load], bool]) -> CheckResult:
    """A burst of 24 at once on a small KV pool: some turned away (503), all admitted exactly right."""
    import asyncio

    import httpx

    from minipd import LLM, SamplingParams
    from minipd.async_llm import AsyncLLM
    from minipd.serve.server import BackgroundServer

    llm = LLM("tiny-py", num_kv_blocks=64, max_num_seqs=4)
    prompts = [f"def function_{i}(x, y):\n    return" for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    errors: list[str] = []

    def rule(load: Load) -> bool:
        try:
            return bool(fn(load))
        except Exception as err:  # the reader's bug: reported, and the request turned away
            errors.append(f"{type(err).__name__}: {err}")
            return False

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return list(await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}) for p in prompts)))

    engine = AsyncLLM.from_llm(llm)
    try:
        with BackgroundServer(engine, "tiny-py", admission=rule) as server:
            responses = asyncio.run(burst(server.url))
    finally:
        engine.shutdown()
    if errors:
        return CheckResult("FAIL", name, f"raised {errors[0]} inside the server")
    refused = [r for r in responses if r.status_code == 503]
    if not refused:
        return CheckResult("FAIL", name, "a burst of 24 requests on 4 running slots was never turned away")
    for i, response in enumerate(responses):
        if response.status_code == 200 and response.json()["choices"][0]["text"] != expected[i]:
            return CheckResult("FAIL", name, f"request {i} was admitted but its text differs from offline greedy",
                               first_mismatch=i)
        if response.status_code not in (200, 503):
            return CheckResult("FAIL", name, f"request {i}: HTTP {response.status_code}")
    if len(refused) == len(responses):
        return CheckResult("FAIL", name, "every request of the burst was turned away")
    return CheckResult("PASS", name)

