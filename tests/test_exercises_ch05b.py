"""Chapter 05b checkers against planted bugs (the three states of every checker: test_exercise_states.py), and the
references against the simulator's own: the decode model against the roofline, the search against find_goodput."""

from __future__ import annotations

import pytest

from minipd.engine.stats import StepWork
from minipd.exercises import ch05b
from minipd.sim.costs import H100_SXM, preset
from minipd.sim.roofline import RooflineStepTime
from minipd.sim.search import find_goodput


def decode_weights_only(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s):
    """Forgets the K/V: right at batch 1 and a short context only."""
    return overhead_s + weight_bytes / bandwidth


def decode_weights_per_row(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s):
    """Reads the weights once per row, as if decode were compute-bound."""
    return overhead_s + (work.decode_rows * weight_bytes + kv_bytes_per_token * work.decode_context) / bandwidth


def decode_no_overhead(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s):
    return ch05b.reference_decode_step_time(work, weight_bytes, kv_bytes_per_token, bandwidth, 0.0)


def decode_shifty(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s):
    """Right on the checker's fixed steps, 10% slow on any other: only the simulation sees it."""
    fixed = {case.args[0] for case in ch05b._decode_cases()}
    seconds = ch05b.reference_decode_step_time(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s)
    return seconds if work in fixed else 1.1 * seconds


def decode_negative(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s):
    """Right on the fixed steps, and a negative time inside the simulation."""
    fixed = {case.args[0] for case in ch05b._decode_cases()}
    seconds = ch05b.reference_decode_step_time(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s)
    return seconds if work in fixed else -1.0


def test_planted_decode_bugs_fail():
    for bug in (decode_weights_only, decode_weights_per_row, decode_no_overhead):
        result = ch05b.check_decode_step_time(bug, simulate=False)
        assert result.status == "FAIL" and "expected" in result.message, bug.__name__
    result = ch05b.check_decode_step_time(decode_shifty)
    assert result.status == "FAIL" and "TPOT came out" in result.message
    assert "with minipd's roofline (+" in result.message
    result = ch05b.check_decode_step_time(decode_negative)
    assert result.status == "FAIL" and "in the simulated cluster" in result.message


def test_the_decode_reference_is_the_roofline_of_a_memory_bound_step():
    """Within 2% of minipd's roofline for decode steps (which also counts FLOPs and activations), and memory-bound
    there, as the exercise says."""
    roofline = RooflineStepTime(preset("llama-3-8b"), H100_SXM)
    inputs = ch05b.decode_inputs("llama-3-8b")
    for rows, context in ((1, 100), (16, 16 * 4000), (64, 64 * 1000), (128, 128 * 2000)):
        work = StepWork(decode_rows=rows, decode_context=context)
        assert roofline.bound(work) == "memory"
        assert ch05b.reference_decode_step_time(work, **inputs) == pytest.approx(roofline.step_time(work), rel=0.02)


def search_upper_end(attainment_at, start, rel_tol=0.05, target=0.9):
    """Bisects, then returns the bracket's upper end: a rate known to miss."""
    found = ch05b.reference_goodput_search(attainment_at, start, rel_tol, target)
    return found * (1 + 2 * rel_tol) if found else found


def search_no_bisection(attainment_at, start, rel_tol=0.05, target=0.9):
    """Doubles only: the answer is up to half the goodput."""
    rate = start
    while attainment_at(2 * rate) >= target:
        rate *= 2
    return rate if attainment_at(rate) >= target else 0.0


def search_never_halves(attainment_at, start, rel_tol=0.05, target=0.9):
    if attainment_at(start) < target:
        return 0.0
    return ch05b.reference_goodput_search(attainment_at, start, rel_tol, target)


def search_scan(attainment_at, start, rel_tol=0.05, target=0.9):
    """A fine scan upwards: right in the end, but a whole simulation per step."""
    rate, best = start / 16, 0.0
    while attainment_at(rate) >= target or rate < start:
        best = rate if attainment_at(rate) >= target else best
        rate *= 1 + rel_tol / 4
    return best


def test_planted_search_bugs_fail():
    assert "known to meet" in ch05b.check_goodput_search(search_upper_end, simulate=False).message
    assert "bisect" in ch05b.check_goodput_search(search_no_bisection, simulate=False).message
    assert ch05b.check_goodput_search(search_never_halves, simulate=False).status == "FAIL"
    assert "runs" in ch05b.check_goodput_search(search_scan, simulate=False).message


def test_the_search_reference_agrees_with_find_goodput_on_the_simulated_cluster():
    run_at, slo, label = ch05b._simulated()

    def attainment_at(rate):
        results = run_at(rate)
        return sum(slo.met(r) for r in results) / len(results)

    ours = ch05b.reference_goodput_search(attainment_at, 2.0)
    theirs, _ = find_goodput(run_at, slo, start=2.0, rel_tol=0.05)
    assert ours == pytest.approx(theirs) and 5 < ours < 200
    assert attainment_at(ours) >= 0.9
    assert "1P+1D of Llama-3-8B" in label
