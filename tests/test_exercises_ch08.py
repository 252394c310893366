"""Chapter 08 checkers against planted bugs (the three states of every checker: test_exercise_states.py).

The references agree with minipd's load generator: ``reference_request_goodput`` with ``summarize``'s
``request_goodput``, ``reference_search_goodput`` with ``search_goodput`` on the same attainment curve.
"""

from __future__ import annotations

import math

from minipd.exercises import ch08
from minipd.serve.app import Load
from minipd.serve.loadgen import RequestResult, Slo, search_goodput, summarize


def goodput_strict(ttfts, tpots, duration, ttft_slo, tpot_slo):
    """A request exactly at its SLO is counted as missing it."""
    return sum(1 for a, b in zip(ttfts, tpots, strict=True) if a < ttft_slo and b < tpot_slo) / duration


def goodput_share(ttfts, tpots, duration, ttft_slo, tpot_slo):
    """The share of requests meeting the SLOs, not a rate."""
    met = sum(1 for a, b in zip(ttfts, tpots, strict=True) if a <= ttft_slo and b <= tpot_slo)
    return met / max(len(ttfts), 1)


def search_scan(attainment_at, low, high, target=0.9, iterations=6):
    """Right answer on a fine grid, at the cost of a load test per grid point."""
    best, rate = 0.0, low
    while rate <= high:
        if attainment_at(rate) >= target:
            best = rate
        rate += (high - low) / 64
    return ch08.reference_search_goodput(attainment_at, low, high, target, iterations) if best else 0.0


def search_returns_upper_end(attainment_at, low, high, target=0.9, iterations=6):
    """Bisects, but returns the final bracket's upper end: a rate not known to meet the target."""
    found = ch08.reference_search_goodput(attainment_at, low, high, target, iterations)
    return found if found in (0.0, high) else found + (high - low) / 2 ** iterations


def admit_ignoring_kv(load):
    return load.in_flight - load.running < ch08.MAX_QUEUE


def admit_counting_running(load):
    return load.in_flight < ch08.MAX_QUEUE and load.kv_usage < ch08.MAX_KV_USAGE


def test_planted_bugs_fail():
    assert ch08.check_request_goodput(goodput_strict).status == "FAIL"
    assert ch08.check_request_goodput(goodput_share).status == "FAIL"
    assert ch08.check_search_goodput(search_scan).status == "FAIL"  # too many runs
    assert ch08.check_search_goodput(search_returns_upper_end).status == "FAIL"
    assert ch08.check_admit(admit_ignoring_kv, live=False).status == "FAIL"
    assert ch08.check_admit(admit_counting_running, live=False).status == "FAIL"


def test_an_admission_rule_that_admits_everything_fails_the_live_burst():
    fixed = {case.args[0] for case in ch08._loads()}

    def shifty(load):
        """Right on the checker's fixed loads, and never says no to any other."""
        return ch08.reference_admit(load) if load in fixed else True

    result = ch08.check_admit(shifty)
    assert result.status == "FAIL" and "never turned away" in result.message


def test_the_references_agree_with_the_load_generator():
    results = [RequestResult(intended=0.0, ok=True, output_tokens=11, ttft=t / 1000, e2el=(t + 10 * p) / 1000)
               for t, p in [(100, 20), (250, 20), (150, 60), (200, 50)]]
    summary = summarize(results, Slo(ttft_ms=200, tpot_ms=50))
    ttfts, tpots = [r.ttft * 1000 for r in results], [r.tpot * 1000 for r in results]
    assert math.isclose(ch08.reference_request_goodput(ttfts, tpots, summary["duration"], 200, 50),
                        summary["request_goodput"], rel_tol=1e-6)
    curve = lambda rate: 1.0 / (1.0 + math.exp((rate - 8.5) * 1.5))  # noqa: E731
    runs = {}

    def run_at(rate):
        share = curve(rate)
        runs[rate] = share
        return [RequestResult(intended=0.0, ok=True, output_tokens=2, ttft=0.1 if i < share * 100 else 9.0, e2el=9.1)
                for i in range(100)]

    found, _ = search_goodput(run_at, Slo(ttft_ms=200), 1.0, 16.0, iterations=6)
    assert math.isclose(found, ch08.reference_search_goodput(lambda r: math.ceil(curve(r) * 100) / 100, 1.0, 16.0))
    assert ch08.reference_admit(Load(0, 0, 0, 0.0)) and not ch08.reference_admit(Load(5, 0, 5, 0.0))


def test_goodput_checker_takes_real_load_test_reports():
    # A loadgen JSON report in miniature: two requests meet 200 ms / 50 ms, one misses its TPOT, one failed.
    report = {"ttfts": [0.05, 0.1, 0.12, 0.0], "itls": [[0.02, 0.03], [0.01, 0.02], [0.2, 0.1], []],
              "output_lens": [3, 3, 3, 0], "errors": ["", "", "", "HTTP 500"], "duration": 2.0, "request_rate": 4.0}
    case = ch08.loadgen_case(report)
    assert len(case.args[0]) == 3 and math.isclose(ch08.reference_request_goodput(*case.args), 1.0)
    assert ch08.check_request_goodput(ch08.reference_request_goodput, [report]).status == "PASS"

    def ignores_tpot(ttfts, tpots, duration, ttft_slo, tpot_slo):
        """Right on the synthetic cases except the TPOT one; wrong on the report (it counts a slow stream)."""
        return sum(t <= ttft_slo for t in ttfts) / duration

    result = ch08.check_request_goodput(ignores_tpot, [report])
    assert result.status == "FAIL"
