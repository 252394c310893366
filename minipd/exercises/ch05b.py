"""Chapter 05b exercises, plugged into the cluster simulator.

- ``decode_step_time``: a decode step's time on a GPU from the bytes it must move (every weight once, the K/V of
  every key it reads, the K/V it writes) over the memory bandwidth, plus a fixed cost. The checker compares it on
  fixed steps, then makes it the step-time model of the decode instance of a simulated 1P+1D cluster (Llama-3-8B
  on H100s) and requires the requests' TPOTs to come out as with minipd's full roofline
  (:class:`~minipd.sim.roofline.RooflineStepTime`: FLOPs too, activations too).
- ``goodput_search``: DistServe's goodput when no upper bound is known: double the rate from a start while at
  least 90% of requests meet the SLOs (or halve it while they do not), then bisect. The checker runs it on
  attainment curves with known edges, then on a simulated cluster, against :func:`minipd.sim.search.find_goodput`.

Each checker prints PASS, FAIL (the first case that differs, or what the simulation then did) or TODO, and never
raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from minipd.engine.stats import StepWork
from minipd.exercises.checking import Case, CheckResult, call_reader, describe_exception, report

__all__ = [
    "check_decode_step_time",
    "check_goodput_search",
    "decode_inputs",
    "reference_decode_step_time",
    "reference_goodput_search",
]


def decode_inputs(model: str = "llama-3-8b", device: Any = None) -> dict[str, float]:
    """The numbers :func:`reference_decode_step_time` takes for a model preset (:func:`minipd.sim.costs.preset`) in
    bf16 on one ``device`` (default the H100 SXM), as minipd's roofline counts them: the bytes of the weights a
    step reads (every layer and the LM head; the embedding table is only looked up), the K/V bytes of one token
    (all layers), the memory bandwidth at the roofline's default efficiency (80%), and its fixed cost per step."""
    from minipd.sim.costs import H100_SXM, count_parameters, kv_bytes_per_token, preset
    from minipd.sim.roofline import DEFAULT_MEMORY_EFFICIENCY, DEFAULT_STEP_OVERHEAD_S

    device = H100_SXM if device is None else device
    config = preset(model)
    params = count_parameters(config)
    weights = 2 * (params.non_embedding + config.vocab_size * config.hidden_size)
    return {"weight_bytes": float(weights), "kv_bytes_per_token": float(kv_bytes_per_token(config, 2)),
            "bandwidth": device.mem_bandwidth * DEFAULT_MEMORY_EFFICIENCY, "overhead_s": DEFAULT_STEP_OVERHEAD_S}


# --- reference solutions ------------------------------------------------------------------------


def reference_decode_step_time(work: StepWork, weight_bytes: float, kv_bytes_per_token: float, bandwidth: float,
                               overhead_s: float) -> float:
    """Seconds a decode step takes when memory is its only limit: every weight read once (whatever the batch), the
    K/V of every key the step's rows attend to (``work.decode_context`` keys in all, each row's own new token
    included) read, and the K/V of each row's new token (``work.decode_rows``) written, all at ``bandwidth``
    bytes/s, plus ``overhead_s``."""
    moved = weight_bytes + kv_bytes_per_token * (work.decode_context + work.decode_rows)
    return overhead_s + moved / bandwidth


def reference_goodput_search(attainment_at: Callable[[float], float], start: float, rel_tol: float = 0.05,
                             target: float = 0.9) -> float:
    """The highest rate at which ``attainment_at(rate)`` (the share of requests meeting the SLOs in a run at that
    rate) is at least ``target``, with no upper bound known in advance.

    From ``start``: while the rate meets the target, double it; if ``start`` already misses, halve it (at most
    ten times; then give up and return 0). That brackets the edge between a rate known to meet the target and
    one known to miss it; bisect the bracket until it is narrower than ``rel_tol`` of its upper end, and return
    its lower end (a rate that met the target)."""
    low, high = 0.0, start
    if attainment_at(start) >= target:
        low, high = start, 2 * start
        while attainment_at(high) >= target:
            low, high = high, 2 * high
    else:
        for _ in range(10):
            candidate = high / 2
            if attainment_at(candidate) >= target:
                low, high = candidate, high
                break
            high = candidate
        else:
            return 0.0
    while high - low > rel_tol * high:
        middle = (low + high) / 2
        if attainment_at(middle) >= target:
            low = middle
        else:
            high = middle
    return low


# --- decode_step_time -----------------------------------------------------------------------------


def _decode_cases() -> list[Case]:
    from minipd.sim.costs import A100_80GB, H200

    llama, opt, h200 = decode_inputs("llama-3-8b"), decode_inputs("opt-13b", A100_80GB), decode_inputs(
        "llama-3-8b", H200)
    cases = []
    for label, inputs in (("Llama-3-8B on an H100", llama), ("OPT-13B on an A100", opt),
                          ("Llama-3-8B on an H200", h200)):
        for rows, context in ((1, 1), (1, 4000), (32, 32 * 800), (128, 128 * 2000)):
            cases.append(Case(f"{label}, {rows} rows, {context} keys", (StepWork(decode_rows=rows,
                                                                                 decode_context=context),),
                              kwargs=dict(inputs)))
    return cases


class _Decode:
    """A step-time model around a reader's function (for the decode instances: decode steps only)."""

    def __init__(self, fn: Callable[..., float], inputs: dict[str, float]) -> None:
        self.fn, self.inputs = fn, inputs
        self.error: str | None = None

    def step_time(self, work: StepWork) -> float:
        try:
            seconds = self.fn(work, **self.inputs)
        except Exception as err:  # the reader's bug: stop the simulation, report it
            self.error = describe_exception(err)
            raise
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            self.error = f"returned {seconds!r} for {work}; a step takes a number of seconds >= 0"
            raise ValueError(self.error)
        return float(seconds)


def _tpots(decode_model: Any) -> list[float]:
    """Each request's TPOT (s) on a 1P+1D cluster of Llama-3-8B on H100s (400G link) whose decode instance runs
    ``decode_model`` (None: minipd's roofline)."""
    import dataclasses

    from minipd.serve.workload import synthetic_workload
    from minipd.sim.cluster import simulate
    from minipd.sim.costs import H100_SXM, preset
    from minipd.sim.roofline import IB_400G
    from minipd.sim.search import GpuCluster

    spec = GpuCluster(preset("llama-3-8b"), H100_SXM, IB_400G).disaggregated(1, 1, 1, 1)
    if decode_model is not None:
        prefill, decode = spec.instances
        spec = dataclasses.replace(spec, instances=(prefill, dataclasses.replace(decode, model=decode_model)))
    result = simulate(spec, synthetic_workload(120, 6.0, "256:2048", "32:256", seed=5))
    return [r.tpot for r in result.requests]


def check_decode_step_time(fn: Callable[..., float], simulate: bool = True) -> CheckResult:
    """Check ``fn(work, weight_bytes, kv_bytes_per_token, bandwidth, overhead_s) -> seconds`` on fixed decode
    steps (within 2% of :func:`reference_decode_step_time`), then (``simulate``) as the decode instance's
    step-time model in a simulated 1P+1D cluster: every request's TPOT within 3% of what minipd's full roofline
    gives there."""
    name = "decode_step_time"
    for index, case in enumerate(_decode_cases()):
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return report(failure)
        expected = reference_decode_step_time(*case.args, **case.kwargs)
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return report(CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected seconds (a float) "
                                                    f"[case: {case.label}]"))
        if not math.isclose(actual, expected, rel_tol=0.02):
            return report(CheckResult("FAIL", name, f"case {index} ({case.label}): got {actual * 1e3:.4g} ms, "
                                                    f"expected {expected * 1e3:.4g} ms",
                                      max_diff=abs(actual - expected), first_mismatch=index))
    if not simulate:
        return report(CheckResult("PASS", name))
    model = _Decode(fn, decode_inputs("llama-3-8b"))
    try:
        ours = _tpots(model)
    except Exception as err:
        return report(CheckResult("FAIL", name, f"in the simulated cluster: {model.error or describe_exception(err)}"))
    roofline = _tpots(None)
    errors = [a / b - 1 for a, b in zip(ours, roofline, strict=True) if b > 0]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    if abs(errors[worst]) > 0.03:
        return report(CheckResult("FAIL", name, f"as the decode instance's model, request {worst}'s TPOT came out "
                                                f"{ours[worst] * 1e3:.2f} ms against {roofline[worst] * 1e3:.2f} ms "
                                                f"with minipd's roofline ({errors[worst]:+.1%})",
                                  max_diff=abs(errors[worst]), first_mismatch=worst))
    return report(CheckResult("PASS", name))


# --- goodput_search -------------------------------------------------------------------------------


class _TooManyRuns(Exception):
    pass


#: Runs a search may make before the checker stops it (doubling from 0.25 to 1,000 and bisecting to 5% takes ~20).
MAX_RUNS = 40


def _counted(curve: Callable[[float], float], calls: list[float]) -> Callable[[float], float]:
    def attainment_at(rate: float) -> float:
        if len(calls) >= MAX_RUNS:
            raise _TooManyRuns(f"more than {MAX_RUNS} runs (each is a whole simulation): does the search stop?")
        if not isinstance(rate, (int, float)) or not rate > 0 or math.isinf(rate):
            raise ValueError(f"asked for a run at rate {rate!r}; a rate is a positive number of requests/s")
        calls.append(float(rate))
        return curve(rate)
    return attainment_at


def _curves() -> list[tuple[str, Callable[[float], float], float]]:
    def edge(at: float) -> Callable[[float], float]:
        return lambda rate: 1.0 if rate <= at else 0.5

    def smooth(knee: float) -> Callable[[float], float]:
        return lambda rate: 1.0 / (1.0 + math.exp((rate - knee) / (0.04 * knee)))

    return [("a sharp edge at 7.3 req/s, start 1", edge(7.3), 1.0),
            ("a sharp edge at 0.3 req/s, start 4 (the start misses)", edge(0.3), 4.0),
            ("a smooth knee around 52 req/s, start 2", smooth(52.0), 2.0),
            ("a sharp edge at 900 req/s, start 0.25", edge(900.0), 0.25),
            ("no rate meets it, start 1", lambda rate: 0.2, 1.0),
            ("an edge exactly at a doubling (8 req/s), start 1", edge(8.0), 1.0)]


def _judge(name: str, label: str, got: Any, reference: float, meets: Callable[[float], bool], rel_tol: float,
           slack: float) -> CheckResult | None:
    """None if ``got`` is a rate that meets the target and is no lower than the reference allows."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or math.isnan(got):
        return CheckResult("FAIL", name, f"returned {got!r}, expected a rate (a float) [case: {label}]")
    if reference == 0.0:
        return None if got == 0 else CheckResult("FAIL", name, f"{label}: got {got:.4g} req/s, but no rate meets "
                                                              "the target: expected 0")
    if got <= 0:
        return CheckResult("FAIL", name, f"{label}: got {got!r}, expected about {reference:.4g} req/s")
    if not meets(got):
        return CheckResult("FAIL", name, f"{label}: at {got:.4g} req/s fewer than 90% of requests meet the SLOs "
                                         "(return the end of the bracket known to meet them)")
    if got < reference * (1 - slack * rel_tol):
        return CheckResult("FAIL", name, f"{label}: got {got:.4g} req/s, expected about {reference:.4g} (bisect "
                                         f"until the bracket is within {rel_tol:.0%} of its upper end)",
                           max_diff=abs(reference - got))
    return None


def _simulated() -> tuple[Callable[[float], list[Any]], Any, str]:
    """A simulated 1P+1D cluster of Llama-3-8B on H100s: ``run_at(rate)`` (its requests' results, memoised: a rate
    asked twice is simulated once), the SLOs, and a label."""
    from minipd.serve.loadgen import Slo
    from minipd.sim.cluster import simulate
    from minipd.sim.costs import H100_SXM, preset
    from minipd.sim.roofline import IB_400G
    from minipd.sim.search import GpuCluster, WorkloadShape

    spec = GpuCluster(preset("llama-3-8b"), H100_SXM, IB_400G).disaggregated(1, 1, 1, 1)
    shape = WorkloadShape("256:1024", "32:128", num_requests=60, duration_s=4.0, seed=3)
    slo = Slo(ttft_ms=200, tpot_ms=15)
    seen: dict[float, list[Any]] = {}

    def run_at(rate: float) -> list[Any]:
        if rate not in seen:
            seen[rate] = simulate(spec, shape.at(rate)).results()
        return seen[rate]

    return run_at, slo, f"{spec.describe()} of Llama-3-8B on H100s, SLOs {slo.ttft_ms:g} ms / {slo.tpot_ms:g} ms"


def check_goodput_search(fn: Callable[..., float], simulate: bool = True) -> CheckResult:
    """Check ``fn(attainment_at, start, rel_tol=0.05, target=0.9) -> rate`` on attainment curves with known edges,
    then (``simulate``) on a simulated cluster against :func:`minipd.sim.search.find_goodput`. A rate passes if it
    meets the target and is within twice the tolerance below the reference's (three times on the simulation,
    whose attainment is not a perfectly monotone function of the rate); a search may make at most
    :data:`MAX_RUNS` runs."""
    name = "goodput_search"
    for label, curve, start in _curves():
        calls: list[float] = []
        got, failure = call_reader(name, fn, Case(label, (_counted(curve, calls), start)))
        if failure is not None:
            return report(failure)
        reference = reference_goodput_search(curve, start)
        verdict = _judge(name, label, got, reference, lambda rate, c=curve: c(rate) >= 0.9, 0.05, 2)
        if verdict is not None:
            return report(verdict)
    if not simulate:
        return report(CheckResult("PASS", name))
    from minipd.serve.loadgen import attainment_share
    from minipd.sim.search import find_goodput

    run_at, slo, label = _simulated()

    def attainment_at(rate: float) -> float:
        return attainment_share(run_at(rate), slo)

    calls = []
    got, failure = call_reader(name, fn, Case(label, (_counted(attainment_at, calls), 2.0)))
    if failure is not None:
        return report(failure)
    reference, _ = find_goodput(run_at, slo, start=2.0, rel_tol=0.05)
    verdict = _judge(name, f"simulated {label}", got, reference, lambda rate: attainment_at(rate) >= 0.9, 0.05, 3)
    return report(verdict or CheckResult("PASS", name))
