"""Goodput and placement: the highest rate a cluster serves within its SLOs, and the best cluster for a device budget.

**Goodput** (DistServe's): the highest request rate at which at least 90% of requests meet both the TTFT
and the TPOT objective. :func:`find_goodput` finds it for any ``run_at(rate)``, simulated or real: it
doubles the rate until attainment fails, then bisects until the bracket is within ``rel_tol``.

**Placement** (:func:`search_placements`): every way to spend a budget of devices on colocated instances
(``n`` instances of tensor-parallel degree ``tp``) or on prefill and decode instances (``p × tp_p +
d × tp_d`` devices), ranked by goodput per device. As DistServe does, a placement is searched as its
smallest *unit* (``4P+2D`` as ``2P+1D``, ``4C`` as ``1C``) whose goodput is then multiplied by the number of
units: the router spreads requests evenly over identical replicas, so they serve independently (a bit
pessimistic: one big pool absorbs bursts better). :func:`search_placements` can simulate the best placements
whole to show what that approximation costs.

Finite runs start empty, so a short run at a high rate never builds the queues it would have in steady
state: :class:`WorkloadShape` makes every run last ``duration_s`` seconds of arrivals (at least
``num_requests`` requests), whatever the rate, and :func:`steady_duration` says how long that must be. A run
only a few request lifetimes long passes rates the cluster cannot sustain (the queue has not grown yet): with
DistServe's chatbot lengths on A100s, 20 s runs found goodputs up to 2.7x those of steady runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minipd.config import ModelConfig
from minipd.engine.stats import StepWork
from minipd.serve.loadgen import RequestResult, Slo, attainment_share, meets
from minipd.serve.workload import PlannedRequest, draw_lengths, synthetic_workload
from minipd.sim.cluster import ClusterSpec, InstanceSpec, simulate
from minipd.sim.costs import DeviceSpec, kv_bytes_per_token
from minipd.sim.instance import InstanceConfig
from minipd.sim.roofline import (
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    DEFAULT_STEP_OVERHEAD_S,
    Link,
    RooflineStepTime,
)


def find_goodput(run_at: Callable[[float], Sequence[RequestResult]], slo: Slo, start: float = 1.0,
                 attainment: float = 0.9, rel_tol: float = 0.03, max_runs: int = 24
                 ) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate (requests/s) at which at least ``attainment`` of the requests ``run_at(rate)`` returns
    meet ``slo``: doubling from ``start`` (or halving, if ``start`` already fails), then bisecting to
    ``rel_tol``. Returns it (0.0 if even ``start / 2**10`` fails) and every (rate, attainment) tried."""
    if start <= 0 or not 0 < attainment <= 1 or rel_tol <= 0:
        raise ValueError(f"need start > 0, 0 < attainment <= 1 and rel_tol > 0; got {start}, {attainment}, {rel_tol}")
    tried: list[tuple[float, float]] = []
    rates = goodput_rates(start, rel_tol, max_runs)
    rate = next(rates)
    while True:
        try:
            rate = rates.send(meets(run_at, rate, slo, attainment, tried))
        except StopIteration as found:
            return found.value, tried


def goodput_rates(start: float, rel_tol: float, max_runs: int = 24) -> Generator[float, bool, float]:
    """:func:`find_goodput`'s rates, one at a time: each ``send`` says whether the last one passed, and the search
    returns the goodput (``StopIteration.value``). Driven this way, several searches can advance side by side."""
    low, high = 0.0, start
    runs = 1
    if (yield start):
        low, high = start, 2 * start
        while runs < max_runs:
            runs += 1
            if not (yield high):
                break
            low, high = high, 2 * high
    else:
        for _ in range(10):
            high, candidate = high / 2, high / 2
            runs += 1
            if (yield candidate):
                low, high = candidate, 2 * candidate
                break
        else:
            return 0.0
    while runs < max_runs and (high - low) > rel_tol * high:
        middle = (low + high) / 2
        runs += 1
        low, high = (middle, high) if (yield middle) else (low, middle)
    return low


def _mean_length(lengths: str | int, name: str) -> float:
    """The mean of a fixed sample of ``lengths`` (as :func:`~minipd.serve.workload.draw_lengths` takes them): the
    same for the same lengths, whatever else is drawn."""
    return float(draw_lengths(lengths, 20_000, np.random.default_rng(0), name).mean())


def steady_duration(output_lens: str | int, slo: Slo, lifetimes: float = 20.0, floor_s: float = 30.0) -> float:
    """Seconds of arrivals for a goodput run to come near steady state: ``lifetimes`` times the life of a request
    of the mean answer length that just meets ``slo`` (its TTFT target plus one TPOT target per token), and at
    least ``floor_s``.

    Why lifetimes: a cluster fills its batches and K/V pools over about one request lifetime, and a rate a few
    percent above what it sustains needs many lifetimes to grow a queue that breaks the TTFT target. On DistServe's
    chatbot workload (OPT-13B, A100s) goodputs found with 20 lifetimes (347 s) agree with 694 s runs within 7%
    (chapter 05b, section 4b); 20 s runs (about one lifetime) overstated them by up to 2.7x."""
    if slo.tpot_ms is None:
        raise ValueError("steady_duration needs slo.tpot_ms: a request's lifetime is counted in TPOT targets")
    if not (lifetimes > 0 and floor_s >= 0):
        raise ValueError(f"need lifetimes > 0 and floor_s >= 0, got {lifetimes} and {floor_s}")
    mean_output = _mean_length(output_lens, "output_lens")
    lifetime_s = ((slo.ttft_ms or 0.0) + mean_output * slo.tpot_ms) / 1e3
    return max(floor_s, lifetimes * lifetime_s)


@dataclass(frozen=True)
class WorkloadShape:
    """What a placement is tested with: request lengths, burstiness, how long (seconds of arrivals, and at
    least how many requests), a seed."""

    prompt_lens: str | int = "256:1024"
    output_lens: str | int = "64:256"
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0
    duration_s: float = 60.0

    def at(self, rate: float) -> list[PlannedRequest]:
        """The workload at ``rate`` requests/s: ``duration_s`` of arrivals, at least ``num_requests`` requests
        (the same lengths, request by request, at every rate)."""
        count = max(self.num_requests, math.ceil(rate * self.duration_s))
        return synthetic_workload(count, rate, self.prompt_lens, self.output_lens, self.burstiness, self.seed)


def placement_goodput(spec: ClusterSpec, workload: WorkloadShape, slo: Slo, start: float = 1.0,
                      attainment: float = 0.9, rel_tol: float = 0.03) -> tuple[float, list[tuple[float, float]]]:
    """:func:`find_goodput` of one placement, simulated on ``workload`` (each run stopping once it is sure to
    fail)."""
    return find_goodput(lambda rate: _search_run(spec, workload, slo, attainment, rate), slo, start=start,
                        attainment=attainment, rel_tol=rel_tol)


def _search_run(spec: ClusterSpec, workload: WorkloadShape, slo: Slo, attainment: float, rate: float
                ) -> list[RequestResult]:
    """One run of a goodput search: ``workload`` at ``rate``, stopped once it is sure to miss ``attainment``."""
    return simulate(spec, workload.at(rate), until_verdict=(slo, attainment)).results()


@dataclass
class PlacementResult:
    """One placement's goodput."""

    spec: ClusterSpec
    goodput: float
    #: (rate, attainment) of every run of the search (on the placement's unit). A run that failed stopped once
    #: that was certain, so its attainment is a lower bound; one that passed ran to its end.
    tried: list[tuple[float, float]] = field(default_factory=list)
    #: With ``verify``: the attainment of the whole placement simulated at :attr:`goodput` (None if not run).
    verified: float | None = None
    #: Set when a search that is not exhaustive stopped short, the placement being no match for the best of its
    #: kind (colocated or disaggregated): its goodput is at least :attr:`goodput` and below this rate.
    upper: float | None = None

    @property
    def per_device(self) -> float:
        return self.goodput / self.spec.devices

    @property
    def upper_per_device(self) -> float | None:
        return None if self.upper is None else self.upper / self.spec.devices

    @property
    def name(self) -> str:
        return self.spec.describe()


@dataclass(frozen=True)
class GpuCluster:
    """How instances of a model are built on a kind of device: the roofline step model, KV capacity from
    the device's memory, engine limits per role, and the link the K/V cross."""

    model: ModelConfig
    device: DeviceSpec
    link: Link
    dtype_bytes: int = 2
    block_size: int = 16
    #: Chunk budget of colocated instances (chunked prefill) and of prefill instances (whole prompts).
    colocated_batched_tokens: int = 2048
    prefill_batched_tokens: int = 16384
    max_num_seqs: int = 256
    colocated_policy: str = "decode-first"
    layerwise: bool = False
    #: The roofline's efficiencies and per-step overhead (see :class:`~minipd.sim.roofline.RooflineStepTime`);
    #: :func:`minipd.sim.calibrate.calibrate` fits the first two to an engine's published figures.
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    #: Control-plane latency of every placement (see :attr:`ClusterSpec.dispatch_latency_s` and
    #: :attr:`ClusterSpec.output_latency_s`): a front end in another process than the engine pays both.
    dispatch_latency_s: float = 0.0
    output_latency_s: float = 0.0

    def step_model(self, tp: int) -> RooflineStepTime:
        return RooflineStepTime(self.model, self.device, tp=tp, dtype_bytes=self.dtype_bytes,
                                compute_efficiency=self.compute_efficiency,
                                memory_efficiency=self.memory_efficiency, step_overhead_s=self.step_overhead_s)

    def config(self, tp: int, role: str) -> InstanceConfig:
        tokens = self.step_model(tp).kv_capacity_tokens(self.device.memory_bytes)
        if tokens < self.block_size:
            raise ValueError(f"{self.model.model_type} does not fit {tp} x {self.device.name} with room for K/V")
        budget = {"colocated": self.colocated_batched_tokens, "prefill": self.prefill_batched_tokens,
                  "decode": self.colocated_batched_tokens}[role]
        policy = self.colocated_policy if role == "colocated" else "decode-first"
        return InstanceConfig(num_kv_blocks=tokens // self.block_size, block_size=self.block_size,
                              max_num_batched_tokens=budget, max_num_seqs=self.max_num_seqs,
                              scheduling_policy=policy, max_model_len=self.model.max_position_embeddings)

    def fits(self, tp: int) -> bool:
        return self.step_model(tp).kv_capacity_tokens(self.device.memory_bytes) >= self.block_size * 64

    def colocated(self, count: int, tp: int) -> ClusterSpec:
        return ClusterSpec.colocated(self.step_model(tp), self.config(tp, "colocated"), count, tp
                                     ).with_control_latency(self.dispatch_latency_s, self.output_latency_s)

    def disaggregated(self, prefill: int, tp_prefill: int, decode: int, tp_decode: int) -> ClusterSpec:
        return ClusterSpec.disaggregated_cluster(
            InstanceSpec("prefill", self.step_model(tp_prefill), self.config(tp_prefill, "prefill"), prefill,
                         tp_prefill),
            InstanceSpec("decode", self.step_model(tp_decode), self.config(tp_decode, "decode"), decode, tp_decode),
            kv_bytes_per_token(self.model, self.dtype_bytes), self.link, self.layerwise,
            self.model.num_hidden_layers).with_control_latency(self.dispatch_latency_s, self.output_latency_s)


def placements(cluster: GpuCluster, devices: int, tps: Sequence[int] = (1, 2, 4, 8),
               colocated: bool = True, disaggregated: bool = True, units_below: bool = False) -> list[ClusterSpec]:
    """Every placement that uses exactly ``devices`` devices, with tensor-parallel degrees from ``tps`` that
    leave room for K/V.

    ``units_below``: also the placements on fewer devices that are no copy of one above (``1P(tp2)+1D`` on three
    of four GPUs; not ``1P+1D``, half of ``2P+2D``): ranked by goodput per device, as DistServe ranks the units
    it then replicates to meet the traffic, they count as much as the ones that fill the budget."""
    specs = _filling(cluster, devices, tps, colocated, disaggregated)
    if units_below:
        seen = {unit_of(spec)[0].describe() for spec in specs}
        for fewer in range(devices - 1, 0, -1):
            for spec in _filling(cluster, fewer, tps, colocated, disaggregated):
                unit = unit_of(spec)[0].describe()
                if unit not in seen:
                    seen.add(unit)
                    specs.append(spec)
    return specs


def _filling(cluster: GpuCluster, devices: int, tps: Sequence[int], colocated: bool, disaggregated: bool
             ) -> list[ClusterSpec]:
    usable = [tp for tp in tps if tp <= devices and cluster.fits(tp)]
    specs = []
    if colocated:
        specs += [cluster.colocated(devices // tp, tp) for tp in usable if devices % tp == 0]
    if disaggregated:
        for tp_p in usable:
            for tp_d in usable:
                for p in range(1, devices // tp_p + 1):
                    rest = devices - p * tp_p
                    if rest >= tp_d and rest % tp_d == 0:
                        specs.append(cluster.disaggregated(p, tp_p, rest // tp_d, tp_d))
    return specs


def unit_of(spec: ClusterSpec) -> tuple[ClusterSpec, int]:
    """The smallest placement ``spec`` is copies of, and how many copies: ``4P+2D`` is 2 × ``2P+1D``."""
    copies = math.gcd(*(s.count for s in spec.instances))
    unit = dataclasses.replace(spec, instances=tuple(dataclasses.replace(s, count=s.count // copies)
                                                     for s in spec.instances))
    return unit, copies


def search_placements(specs: Sequence[ClusterSpec], workload: WorkloadShape, slo: Slo, attainment: float = 0.9,
                      rel_tol: float = 0.05, verify: int = 0, progress: bool = False, workers: int = 1,
                      exhaustive: bool = True) -> list[PlacementResult]:
    """The goodput of each placement on ``workload`` (its unit's, times the copies), best per device first.

    Each unit's search starts at a power of two near its prefill capacity (:func:`search_start`; doubling or
    halving from there, then bisecting), so what an exhaustive search finds for a unit depends on nothing but the
    unit and the workload: not on the order of ``specs``, on which placements were searched before, or on
    ``workers``.

    ``exhaustive=False``: branch and bound. The searches advance side by side, one run each per round, and a
    unit stops once the lowest rate it failed at, per device, is no more than the best rate per device that a unit
    of its kind (colocated or disaggregated) has passed: it cannot be the best of its kind. The best colocated and
    the best disaggregated placements get exactly the goodput an exhaustive search finds; the others that too, or a
    bracket (:attr:`PlacementResult.upper`; ranked by its lower end, so a bracket may sit below a placement it
    beats). Rounds wait for all their runs, so the result does not depend on ``workers``.

    ``verify``: simulate that many of the best placements whole as well, at the goodput found, and keep the
    share of requests that met the SLOs there in :attr:`PlacementResult.verified`.
    ``workers``: search that many units at once, each in a process of its own (spawned: the simulator is pure
    Python, so threads would share one core); the placements must then be picklable and their classes importable
    there (a step-time model defined in a notebook cell is not: use ``workers=1``), and a script that asks for
    workers must start from ``if __name__ == "__main__":``, as spawned processes import it again."""
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    units: dict[str, ClusterSpec] = {}
    for spec in specs:
        unit, _ = unit_of(spec)
        units.setdefault(unit.describe(), unit)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(units), desc="placements", unit="placement", leave=False)
    with _Processes(min(workers, len(units))) as processes:
        try:
            if exhaustive:
                # Largest units first: with several workers, the longest searches do not start last.
                tasks = [(key, unit, workload, slo, attainment, rel_tol)
                         for key, unit in sorted(units.items(), key=lambda item: -item[1].devices)]
                found = {key: (rate, tried, None) for key, (rate, tried) in processes.map(_search_unit, tasks, bar)}
            else:
                found = _branch_and_bound(units, workload, slo, attainment, rel_tol, processes, bar)
        finally:
            if bar is not None:
                bar.close()
        ranked = _ranked(specs, found)
        checked = [r for r in ranked[:verify] if r.goodput > 0]
        # A placement that is its own unit was run whole at its goodput by the search, to its end (it passed).
        shares = {i: dict(r.tried)[r.goodput] for i, r in enumerate(checked) if unit_of(r.spec)[1] == 1}
        shares.update(processes.map(_verify_placement, [(i, r.spec, workload, r.goodput, slo)
                                                         for i, r in enumerate(checked) if i not in shares]))
    for index, result in enumerate(checked):
        result.verified = shares[index]
    return ranked


def _ranked(specs: Sequence[ClusterSpec], found: dict[str, tuple[float, list[tuple[float, float]], float | None]]
            ) -> list[PlacementResult]:
    results = []
    for spec in specs:
        unit, copies = unit_of(spec)
        rate, tried, upper = found[unit.describe()]
        results.append(PlacementResult(spec, rate * copies, tried, upper=None if upper is None else upper * copies))
    return sorted(results, key=lambda r: -r.per_device)


def _branch_and_bound(units: dict[str, ClusterSpec], workload: WorkloadShape, slo: Slo, attainment: float,
                      rel_tol: float, processes: _Processes, bar: Any
                      ) -> dict[str, tuple[float, list[tuple[float, float]], float | None]]:
    """:func:`search_placements` with ``exhaustive=False``: (goodput, runs, upper bound or None) by unit."""
    searches = {key: goodput_rates(search_start(unit, workload), rel_tol) for key, unit in units.items()}
    next_rate = {key: next(search) for key, search in searches.items()}
    tried: dict[str, list[tuple[float, float]]] = {key: [] for key in units}
    found: dict[str, tuple[float, list[tuple[float, float]], float | None]] = {}

    def passed(key: str) -> float:
        return max((rate for rate, share in tried[key] if share >= attainment), default=0.0)

    def failed(key: str) -> float:
        return min((rate for rate, share in tried[key] if share < attainment), default=math.inf)

    while next_rate:
        best = {kind: max((passed(k) / u.devices for k, u in units.items() if u.disaggregated == kind), default=0.0)
                for kind in (False, True)}
        for key in list(next_rate):
            unit = units[key]
            if failed(key) / unit.devices <= best[unit.disaggregated]:  # it failed where another of its kind passed
                found[key] = (passed(key), tried[key], failed(key))
                del next_rate[key]
        # Most requests first (a run's cost grows with them): a round's last run is a short one.
        order = sorted(next_rate, key=lambda k: -next_rate[k])
        tasks = [(key, units[key], workload, slo, attainment, next_rate[key]) for key in order]
        for key, share in processes.map(_run_unit, tasks):
            tried[key].append((next_rate[key], share))
            try:
                next_rate[key] = searches[key].send(share >= attainment)
            except StopIteration as stop:
                found[key] = (stop.value, tried[key], None)
                del next_rate[key]
        if bar is not None:
            bar.update(len(found) - bar.n)
    return found


def _run_unit(task: tuple) -> tuple[str, float]:
    key, unit, workload, slo, attainment, rate = task
    return key, attainment_share(_search_run(unit, workload, slo, attainment, rate), slo)


def search_start(unit: ClusterSpec, workload: WorkloadShape) -> float:
    """Where :func:`search_placements` starts a unit's search: a power of two, so that the search brackets the
    goodput between the same two powers of two wherever it starts (and finds the same goodput, attainment
    falling as the rate rises); the one at or below the rate at which the unit's prefill steps alone, one mean
    prompt each, would keep it busy, which its goodput seldom exceeds by much. Starting near the answer saves the
    runs of doubling up to it: a unit serving hundreds of requests/s would otherwise take seven from 4."""
    mean_prompt = max(1, round(_mean_length(workload.prompt_lens, "prompt_lens")))
    prompt = StepWork.of(((mean_prompt, mean_prompt),), 0, 0)
    try:
        rate = sum(s.count / s.model.step_time(prompt) for s in unit.instances if s.role != "decode")
    except Exception:  # (a model that cannot answer outside a run, or says 0 s: only the start is at stake)
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        rate = float(unit.devices)  # one request/s per device
    return 2.0 ** math.floor(math.log2(rate))


def _search_unit(task: tuple) -> tuple[str, tuple[float, list[tuple[float, float]]]]:
    key, unit, workload, slo, attainment, rel_tol = task
    return key, placement_goodput(unit, workload, slo, start=search_start(unit, workload), attainment=attainment,
                                  rel_tol=rel_tol)


def _verify_placement(task: tuple) -> tuple[int, float]:
    index, spec, workload, rate, slo = task
    return index, simulate(spec, workload.at(rate)).attainment(slo)


def _ignore_interrupts() -> None:
    """In a worker: Ctrl-C is the parent's to handle (it stops the workers), not a traceback per worker."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Processes:
    """Runs tasks here (``workers=1``) or in up to ``workers`` spawned processes, started at the first tasks that
    need them and stopped (not waited for) on leaving, even when something failed or was interrupted. A worker
    that dies (killed, out of memory, or unable to start: a script without ``if __name__ == "__main__":``)
    raises ``BrokenProcessPool`` here rather than leaving its task waited for."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: Any = None

    def __enter__(self) -> _Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is None:
            return
        processes = list(getattr(self._pool, "_processes", {}).values())  # (private: no public way to stop them)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)

    def map(self, function: Callable[[tuple], tuple], tasks: list[tuple], bar: Any = None) -> list:
        """``function`` over ``tasks``, results in any order (``bar`` counts them)."""
        if self.workers <= 1 or len(tasks) <= 1:
            out = []
            for task in tasks:
                out.append(function(task))
                if bar is not None:
                    bar.update(1)
            return out
        import pickle
        import sys

        try:
            sent = pickle.dumps(tasks)
        except Exception as err:
            raise ValueError(f"workers={self.workers} sends each placement to another process, and these cannot "
                             f"be pickled ({err}); use workers=1") from err
        if b"__main__" in sent and getattr(sys.modules["__main__"], "__file__", None) is None:
            # (A class from a notebook cell pickles by name, and a spawned process has no such notebook to import.)
            raise ValueError(f"workers={self.workers} sends each placement to another process, and these use a "
                             "class defined in this notebook or session, which that process cannot import; define "
                             "it in a module, or use workers=1")
        from concurrent.futures import ProcessPoolExecutor, as_completed

        if self._pool is None:
            import multiprocessing

            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_ignore_interrupts)
        out = []
        for future in as_completed([self._pool.submit(function, task) for task in tasks]):
            out.append(future.result())
            if bar is not None:
                bar.update(1)
        return out


__all__ = ["GpuCluster", "PlacementResult", "WorkloadShape", "find_goodput", "placement_goodput", "placements",
           "search_placements", "search_start", "steady_duration", "unit_of"]
