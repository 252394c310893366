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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minipd.config import ModelConfig
from minipd.serve.loadgen import RequestResult, Slo, meets
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

    def ok(rate: float) -> bool:
        return meets(run_at, rate, slo, attainment, tried)

    low, high = 0.0, start
    if ok(start):
        low, high = start, 2 * start
        while len(tried) < max_runs and ok(high):
            low, high = high, 2 * high
    else:
        for _ in range(10):
            high, candidate = high / 2, high / 2
            if ok(candidate):
                low, high = candidate, 2 * candidate
                break
        else:
            return 0.0, tried
    while len(tried) < max_runs and (high - low) > rel_tol * high:
        middle = (low + high) / 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low, tried


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
    # The mean of a fixed sample: the same duration for the same lengths, whatever else is drawn.
    mean_output = float(draw_lengths(output_lens, 20_000, np.random.default_rng(0), "output_lens").mean())
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
    """:func:`find_goodput` of one placement, simulated on ``workload`` (each run stopping once its verdict is
    certain)."""
    return find_goodput(lambda rate: simulate(spec, workload.at(rate), until_verdict=(slo, attainment)).results(),
                        slo, start=start, attainment=attainment, rel_tol=rel_tol)


@dataclass
class PlacementResult:
    """One placement's goodput."""

    spec: ClusterSpec
    goodput: float
    #: (rate, attainment) of every run of the search (on the placement's unit). Each run stopped once its
    #: verdict was certain, so an attainment is a lower bound, on the right side of the target.
    tried: list[tuple[float, float]] = field(default_factory=list)
    #: With ``verify``: the attainment of the whole placement simulated at :attr:`goodput` (None if not run).
    verified: float | None = None

    @property
    def per_device(self) -> float:
        return self.goodput / self.spec.devices

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
                      rel_tol: float = 0.05, verify: int = 0, progress: bool = False) -> list[PlacementResult]:
    """The goodput of each placement on ``workload`` (its unit's, times the copies), best per device first.

    ``verify``: simulate that many of the best placements whole as well, at the goodput found, and keep the
    share of requests that met the SLOs there in :attr:`PlacementResult.verified`."""
    units: dict[str, tuple[float, list[tuple[float, float]]]] = {}
    results = []
    iterator = specs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(specs, desc="placements", unit="placement", leave=False)
    per_device = 1.0
    for spec in iterator:
        unit, copies = unit_of(spec)
        key = unit.describe()
        if key not in units:
            # Each search starts near the last goodput per device found: fewer doublings.
            units[key] = placement_goodput(unit, workload, slo, start=per_device * unit.devices,
                                           attainment=attainment, rel_tol=rel_tol)
            if units[key][0] > 0:
                per_device = units[key][0] / unit.devices
        rate, tried = units[key]
        results.append(PlacementResult(spec, rate * copies, tried))
    ranked = sorted(results, key=lambda r: -r.per_device)
    for result in ranked[:verify]:
        if result.goodput > 0:
            result.verified = simulate(result.spec, workload.at(result.goodput)).attainment(slo)
    return ranked


__all__ = ["GpuCluster", "PlacementResult", "WorkloadShape", "find_goodput", "placement_goodput", "placements",
           "search_placements", "steady_duration", "unit_of"]
