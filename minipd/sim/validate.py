"""Checking the simulator against the engine: the same workload run for real and simulated.

- :func:`run_engine` drives a real engine (an :class:`~minipd.LLM` or a
  :class:`~minipd.pd.llm.DisaggregatedLLM`) open loop: each request enters at its arrival time, and
  every token's time is recorded as a client would see it;
- :func:`instance_config` reads the engine settings a simulated instance needs from a real engine;
- :class:`ReplayStepTime` gives the simulator the step durations a real run measured, in order, so the
  only thing left to compare is the scheduling (:func:`scheduling_agreement`);
- :func:`fit_link` fits a transfer's fixed cost and bandwidth to the transfers a disaggregated run timed, and
  :func:`fit_control_latency` the time its control messages take (to the prefill worker, back to the client);
- :func:`compare` puts the real and simulated latencies side by side, and :func:`within_targets` says whether a
  row of it is as close as the simulator is asked to be (:data:`TARGETS`); :func:`against_runs` judges a
  simulation against several real runs of one workload, and each of those runs against the others.
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minipd.engine.stats import StepStats, StepWork
from minipd.sampling_params import SamplingParams
from minipd.serve.loadgen import BASE_TEXT, RequestResult, Slo, summarize
from minipd.serve.workload import PlannedRequest, prompt_ids
from minipd.sim.cluster import SimResult
from minipd.sim.fitted import cycle_times
from minipd.sim.instance import InstanceConfig

if TYPE_CHECKING:
    from minipd.sim.roofline import Link


@dataclass
class RealRun:
    """A workload run on a real engine."""

    results: list[RequestResult]
    #: Every step the engine (or each disaggregated worker, named in ``StepStats.worker``) took.
    steps: list[StepStats]
    #: When each request entered the engine, seconds from the run's start (the simulator's arrivals).
    entered: list[float]
    #: Disaggregated runs: (bytes, seconds) of every K/V transfer, the seconds those the decode side waited
    #: (what was hidden under the prefill step left out).
    transfers: list[tuple[int, float]] = field(default_factory=list)
    #: ``time.perf_counter()`` at the run's start (step records are in that clock).
    start: float = 0.0

    def to_json(self) -> str:
        """The run as JSON (steps, results, arrivals, transfers), to measure on one machine and study on another."""
        return json.dumps({"steps": [dataclasses.asdict(s) for s in self.steps],
                           "results": [dataclasses.asdict(r) for r in self.results], "entered": self.entered,
                           "transfers": self.transfers, "start": self.start})

    @classmethod
    def from_json(cls, text: str) -> RealRun:
        raw = json.loads(text)
        tuples = {f.name for f in dataclasses.fields(StepStats) if str(f.type).startswith("tuple")}
        steps = [StepStats(**{k: tuple(v) if k in tuples else v for k, v in s.items()}) for s in raw["steps"]]
        return cls([RequestResult(**r) for r in raw["results"]], steps, raw["entered"],
                   [tuple(t) for t in raw["transfers"]], raw["start"])

    def results_from_entry(self) -> list[RequestResult]:
        """The results timed from when each request entered the engine, not from when it was due (for a
        replay, whose arrivals are the entries)."""
        return [dataclasses.replace(r, intended=t, ttft=r.ttft + r.intended - t, e2el=r.e2el + r.intended - t)
                for r, t in zip(self.results, self.entered, strict=True)]

    def workload(self) -> list[PlannedRequest]:
        """The workload as it really entered the engine (arrivals as sent, lengths as produced)."""
        return [PlannedRequest(t, r.prompt_tokens, r.output_tokens) for t, r in zip(self.entered, self.results,
                                                                                    strict=True)]


def load_runs(path: str | Path) -> tuple[dict[str, Any], dict[float, RealRun]]:
    """Real runs stored by ``scripts/gpu_sim_calibration.py`` (JSON, gzipped when the name ends in ``.gz``):
    what was measured (device, model, engine options) and the runs by request rate."""
    raw = Path(path).read_bytes()
    report = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    runs = {float(rate): RealRun.from_json(json.dumps(run)) for rate, run in report.pop("runs").items()}
    return report, runs


def instance_config(llm: Any) -> InstanceConfig:
    """The settings of a colocated engine (an ``LLM``) as a simulated instance takes them."""
    scheduler = llm.engine.core.scheduler
    if scheduler.block_manager.enable_prefix_caching:
        raise ValueError("the simulator models no prefix cache: build the engine with enable_prefix_caching=False")
    return InstanceConfig(num_kv_blocks=scheduler.block_manager.num_blocks,
                          block_size=scheduler.block_manager.block_size,
                          max_num_batched_tokens=scheduler.max_num_batched_tokens,
                          max_num_seqs=scheduler.max_num_seqs, scheduling_policy=scheduler.policy.name,
                          max_model_len=llm.engine.core.max_model_len)


def run_engine(engine: Any, workload: Sequence[PlannedRequest], progress: bool = False) -> RealRun:
    """Run ``workload`` on ``engine`` (an ``LLM`` or a ``DisaggregatedLLM`` with nothing in flight) in this
    thread, each request entering when its time comes; greedy, ``ignore_eos``, so each makes exactly its
    output length. Prompts are cut from the tokens of a fixed text, so they differ from each other."""
    from minipd.pd.llm import DisaggregatedLLM

    base = engine.get_tokenizer().encode(BASE_TEXT)
    disaggregated = isinstance(engine, DisaggregatedLLM)
    front = engine if disaggregated else engine.engine

    def step(wait: float) -> list[_Event]:
        # (A disaggregated front end waits for the workers' messages: never past the next arrival.)
        deltas = engine.step(timeout=min(0.002, wait)) if disaggregated else front.step()
        return [(d.request_id, int(d.token_id is not None), d.finished, _transfer(d) if d.finished else None)
                for d in deltas]

    return _drive(front.core, front.add_request, step, front.has_unfinished_requests, workload,
                  lambda index, item: prompt_ids(base, item.prompt_len, index), progress)


#: What one step said about one request: its id, how many tokens it got, whether it finished, and (bytes,
#: seconds) of its K/V transfer when it finished after one.
_Event = tuple[str, int, bool, "tuple[int, float] | None"]


def _transfer(delta: Any) -> tuple[int, float] | None:
    """(bytes, seconds) of a request's K/V transfer that the decode side waited for: the span from first
    write to last completion, less the share of it that lay under the prefill step (layer-wise and push
    modes send while the prefill computes)."""
    metrics = delta.output.metrics
    if metrics.kv_transfer_start is None or metrics.kv_transfer_end is None:
        return None
    span = metrics.kv_transfer_end - metrics.kv_transfer_start
    return metrics.kv_transfer_bytes, span * (1.0 - (metrics.kv_transfer_hidden or 0.0))


def _drive(core: Any, add: Any, step: Any, busy: Any, workload: Sequence[PlannedRequest], prompt: Any,
           progress: bool) -> RealRun:
    """The open loop of :func:`run_engine`: ``add(ids, params, request_id)``, ``step(seconds to the next
    arrival) -> events`` (see ``_Event``), ``busy()``; the steps are read from ``core``'s step callbacks."""
    if busy():
        raise ValueError("the engine has requests in flight; finish or abort them first")
    n = len(workload)
    params = {o: SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in {p.output_len for p in workload}}
    times: dict[str, list[float]] = {str(i): [] for i in range(n)}
    finished: dict[str, float] = {}
    transfers: list[tuple[int, float]] = []
    entered = [0.0] * n
    steps: list[StepStats] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc="real run", unit="req", leave=False)
    core.step_callbacks.append(steps.append)  # every step of this run, however many the engine keeps
    start = time.perf_counter()
    index = 0
    try:
        while index < n or busy():
            now = time.perf_counter() - start
            while index < n and workload[index].send_at <= now:
                entered[index] = time.perf_counter() - start  # (before the engine has it: its next step sees it)
                add(prompt(index, workload[index]), params[workload[index].output_len], str(index))
                index += 1
            following = workload[index].send_at - (time.perf_counter() - start) if index < n else 1.0
            if not busy():
                time.sleep(max(0.0, following))
                continue
            events = step(max(0.0, following))
            stamp = time.perf_counter() - start
            for request_id, tokens, done, transfer in events:
                times[request_id].extend([stamp] * tokens)
                if done:
                    finished[request_id] = stamp
                    if transfer is not None:
                        transfers.append(transfer)
                    if bar is not None:
                        bar.update(1)
    finally:
        core.step_callbacks.remove(steps.append)
        if bar is not None:
            bar.close()
    results = []
    for i, item in enumerate(workload):
        stamps = times[str(i)]
        ok = bool(stamps) and str(i) in finished
        results.append(RequestResult(item.send_at, entered[i], ok, "" if ok else "unfinished", item.prompt_len,
                                     len(stamps), stamps[0] - item.send_at if stamps else 0.0,
                                     finished.get(str(i), 0.0) - item.send_at,
                                     [b - a for a, b in itertools.pairwise(stamps)]))
    return RealRun(results, steps, entered, transfers, start)


def run_core(core: Any, workload: Sequence[PlannedRequest], vocab_size: int, seed: int = 0) -> RealRun:
    """Run ``workload`` on an engine core (an :class:`~minipd.engine.core.EngineCore`, say on a GPU with random
    weights) in this thread, as :func:`run_engine` does for an ``LLM``, with random prompt tokens and no
    tokenizer."""
    from minipd.engine.request import Request

    rng = np.random.default_rng(seed)

    def add(ids: list[int], params: SamplingParams, request_id: str) -> None:
        core.add_request(Request(request_id=request_id, all_token_ids=ids, num_prompt_tokens=len(ids), params=params,
                                 seed=0, eos_token_ids=frozenset(), max_model_len=core.max_model_len,
                                 arrival_time=time.perf_counter()))

    def step(wait: float) -> list[_Event]:
        return [(out.request_id, len(out.new_token_ids), out.finished, None) for out in core.step().outputs]

    return _drive(core, add, step, core.has_unfinished_requests, workload,
                  lambda index, item: rng.integers(0, vocab_size, item.prompt_len).tolist(), progress=False)


class ReplayStepTime:
    """The steps of a real run, replayed: simulated step ``i`` ends when the real step ``i`` ended (at the
    next step's start while the engine stayed busy, so the time between steps counts too), whatever the
    simulation's clock says when it starts. The simulation gives it its clock (:meth:`bind`). Also records
    what each simulated step computed, for :func:`scheduling_agreement`."""

    def __init__(self, steps: Sequence[StepStats], origin: float) -> None:
        steps = list(steps)
        times = cycle_times(steps)
        self.ends = [s.start_time - origin + t for s, t in zip(steps, times, strict=True)]
        self.works: list[StepWork] = []
        self._clock: Any = None

    def bind(self, clock: Any) -> None:
        """Use ``clock()`` (the simulation's time) to tell how long is left of each step."""
        self._clock = clock

    def step_time(self, work: StepWork) -> float:
        index = len(self.works)
        self.works.append(work)
        if self._clock is None:
            raise RuntimeError("ReplayStepTime needs the simulation's clock: run it through simulate()")
        end = self.ends[index] if index < len(self.ends) else self._clock()
        return max(0.0, end - self._clock())


def scheduling_agreement(real_steps: Sequence[StepStats], replayed: ReplayStepTime) -> float:
    """Share of the real run's steps whose batch (prompt tokens, prefill rows, decode rows) the replay matched."""
    if not real_steps:
        return 0.0
    same = sum(1 for real, sim in zip(real_steps, replayed.works, strict=False)
               if (real.work.prefill_tokens, real.work.prefill_rows, real.work.decode_rows)
               == (sim.prefill_tokens, sim.prefill_rows, sim.decode_rows))
    return same / max(len(real_steps), len(replayed.works))


def fit_link(transfers: Sequence[tuple[int, float]], name: str = "measured") -> Link:
    """A link whose ``latency + bytes / bandwidth`` fits the measured transfers (least squares)."""
    from minipd.sim.roofline import Link

    if len(transfers) < 2:
        raise ValueError("need at least two measured transfers to fit a link")
    size = np.array([b for b, _ in transfers], dtype=float)
    seconds = np.array([t for _, t in transfers], dtype=float)
    if np.ptp(size) == 0:
        return Link(name, float("inf"), float(np.median(seconds)))
    slope, intercept = np.polyfit(size, seconds, 1)
    slope, intercept = max(float(slope), 1e-15), max(float(intercept), 0.0)
    return Link(name, 1.0 / slope, intercept)


def fit_control_latency(runs: Sequence[RealRun], push: bool = False) -> tuple[float, float]:
    """(dispatch, output) seconds of a disaggregated engine's control messages, as
    :meth:`~minipd.sim.cluster.ClusterSpec.with_control_latency` takes them, measured on real runs with one
    prefill worker: each request's prompt is matched to the prefill step that completed it (first come, first
    served: prompts complete in the order they entered). Output is the median from the end of the step that
    completed its prompt, as the simulator times it (:func:`~minipd.sim.fitted.cycle_times`: with the worker's
    own work before its next step where measured), to the client's first token. The median wait from a request's
    entry to the start of its first prefill step, over the requests that found that worker idle (no queue in it,
    the step before over), is one dispatch; with
    ``push`` (the K/V pushed into blocks reserved first, :attr:`~minipd.sim.cluster.ClusterSpec.push`) it is a
    dispatch to the decode worker, its reply and a dispatch to the prefill worker, and one dispatch is what is
    left of it after the reply, halved (it also holds the decode worker's wait for the end of its step before it
    reserves, which the simulator adds again: a fraction of a step, counted twice)."""
    dispatch: list[float] = []
    output: list[float] = []
    for run in runs:
        steps = sorted((s for s in run.steps if s.prefill_chunk_sizes and not s.worker.startswith("decode")),
                       key=lambda s: s.start_time)
        if len({s.worker for s in steps}) > 1:
            raise ValueError("fit_control_latency matches prompts to steps in order: one prefill worker only")
        order = sorted(range(len(run.results)), key=lambda i: run.entered[i])
        completions = []  # (step index) per request, in entry order
        for index, step in enumerate(steps):
            for context in step.prefill_chunk_contexts:
                if len(completions) < len(order) and context == run.results[order[len(completions)]].prompt_tokens:
                    completions.append(index)
        if len(completions) != len(order):
            raise ValueError(f"matched {len(completions)} of {len(order)} prompts to prefill steps: not a run of "
                             "one prefill worker serving in order, without a prefix cache")
        starts = [s.start_time for s in steps]
        ends = [s.start_time + t for s, t in zip(steps, cycle_times(steps), strict=True)]
        for request, index in zip(order, completions, strict=True):
            result = run.results[request]
            entered = run.start + run.entered[request]
            # Its first chunk's step is the first to start after it entered, if the worker was idle then (the
            # step before over, its loop's work after it too).
            first = bisect.bisect_left(starts, entered)
            if first <= index and (not first or ends[first - 1] <= entered):
                dispatch.append(starts[first] - entered)
            if result.ok:
                output.append(run.start + result.intended + result.ttft - ends[index])
    if not dispatch or not output:
        raise ValueError("no request found its prefill worker idle: run a lighter load to measure dispatch")
    to_prefill, back = float(np.median(dispatch)), max(0.0, float(np.median(output)))
    return max(0.0, (to_prefill - back) / 2 if push else to_prefill), back


#: The figures :func:`compare` puts side by side.
FIGURES = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "slo_attainment")


def figure_error(key: str, value: float, reference: float) -> float:
    """How far ``value`` is from ``reference`` for figure ``key``: relative for latencies (0.1 is 10% longer),
    absolute for the SLO attainment (a share: 0.03 is 3 points)."""
    if key == "slo_attainment":
        return value - reference
    return value / reference - 1 if reference else 0.0


def compare(real: Sequence[RequestResult], sim: SimResult | Sequence[RequestResult], slo: Slo | None = None
            ) -> dict[str, dict[str, float]]:
    """P50 and P90 of TTFT and TPOT (ms) and SLO attainment, real beside simulated, with the relative error."""
    simulated = sim.results() if isinstance(sim, SimResult) else list(sim)
    ours, theirs = summarize(list(real), slo), summarize(simulated, slo)
    return {key: {"real": ours[key], "sim": theirs[key], "error": figure_error(key, theirs[key], ours[key])}
            for key in FIGURES}


def against_runs(real: Sequence[Sequence[RequestResult]], sim: SimResult | Sequence[RequestResult],
                 slo: Slo | None = None) -> dict[str, Any]:
    """The simulation of one workload against several real runs of it, and each real run against the others.

    One run of a shared machine is one sample of it: its P50 TTFT near the knee moves by tens of percent from one
    run to the next, so the simulation is judged against the median of every real run, figure by figure; and each
    real run against the median of the others, by the same :data:`TARGETS`, says how close the machine lets a run
    come to its own siblings. Returns ``runs`` (how many), ``real`` (each run's figures, in order), ``real_median``
    and ``sim`` (the figures), ``errors`` and ``within_targets`` (the simulation's), ``real_errors`` (each run's
    against the others' median, in order) and ``real_within`` (how many of the runs are within every target of
    it)."""
    if len(real) < 2:
        raise ValueError(f"against_runs needs at least 2 real runs of the workload, got {len(real)}")
    figures = [summarize(list(run), slo) for run in real]
    simulated = summarize(sim.results() if isinstance(sim, SimResult) else list(sim), slo)

    def median(tables: list[dict[str, Any]]) -> dict[str, float]:
        return {key: float(np.median([t[key] for t in tables])) for key in FIGURES}

    middle = median(figures)
    errors = {key: figure_error(key, simulated[key], middle[key]) for key in FIGURES}
    real_errors = []
    for i, own in enumerate(figures):
        others = median(figures[:i] + figures[i + 1:])
        real_errors.append({key: figure_error(key, own[key], others[key]) for key in FIGURES})
    return {"runs": len(real), "real": [{key: float(t[key]) for key in FIGURES} for t in figures],
            "real_median": middle, "sim": {key: float(simulated[key]) for key in FIGURES}, "errors": errors,
            "within_targets": errors_within_targets(errors), "real_errors": real_errors,
            "real_within": sum(errors_within_targets(e) for e in real_errors)}


#: How close a simulated row must come to the real one: P50 latencies within 10%, P90s within 20% (relative
#: errors), SLO attainment within 3 points (an absolute difference).
TARGETS = {"median_ttft_ms": 0.10, "median_tpot_ms": 0.10, "p90_ttft_ms": 0.20, "p90_tpot_ms": 0.20,
           "slo_attainment": 0.03}


def within_targets(row: dict[str, dict[str, float]]) -> bool:
    """Whether every figure of a :func:`compare` table (or a row of ``scripts/validate_simulator.py``'s report)
    is within its :data:`TARGETS` bound (a bound met exactly counts: attainments are multiples of one request's
    share, and their difference lands on 3 points exactly, give or take the last bit, often)."""
    return errors_within_targets({key: row[key]["error"] for key in TARGETS})


def errors_within_targets(errors: dict[str, float]) -> bool:
    """Whether every error (by figure, as :func:`figure_error` gives it) is within its :data:`TARGETS` bound."""
    return all(error_within_target(key, errors[key]) for key in TARGETS)


def error_within_target(key: str, error: float) -> bool:
    """Whether one figure's error (as :func:`figure_error` gives it) is within its :data:`TARGETS` bound."""
    return abs(error) <= TARGETS[key] + 1e-9


__all__ = ["FIGURES", "TARGETS", "RealRun", "ReplayStepTime", "against_runs", "compare", "error_within_target",
           "errors_within_targets", "figure_error", "fit_control_latency", "fit_link", "instance_config", "load_runs",
           "run_core", "run_engine", "scheduling_agreement", "within_targets"]
