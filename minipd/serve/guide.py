"""Choosing a deployment: the source article's selection guide, with its thresholds computed rather than asserted.

The guide says: short text, one dense instance (no network cost); long text, a prefill/decode split with a
compressed KV cache (memory); very large models, a mixture of experts sharded over devices. Here each rule
is a number:

- **Does the model fit one device?** Its weights (:func:`minipd.sim.costs.count_parameters`) against the
  device's memory with room left for the KV cache (``weights_share``). If not: shard it; a MoE model is
  sharded by experts (chapter 07), a dense one by tensor parallelism.
- **Does the KV cache of the requests in flight fit?** Little's law gives the requests in flight (rate
  × time each spends), :func:`~minipd.sim.costs.kv_bytes_per_token` their cache. A cache that overflows the
  memory left calls for an int8 cache (half of bf16's bytes: chapter 06) and the split.
- **Colocated or split?** With ``simulate=True`` the guide asks chapter 05b's cluster simulator
  (:func:`simulate_goodput`): the split is recommended when a 1 prefill + 1 decode pair serves more requests
  per GPU within the SLOs than a colocated instance does. Without it, the article's rule of thumb: prompts of
  at least ``long_prompt`` tokens (4096 by default, a round number from the article's "long context", not a
  measurement) call for the split.
- Otherwise one dense instance.

Two predicted goodputs can come with the advice: the simulator's, per GPU at GPU scale for the model and
workload chosen (``simulate=True``); and, given a :class:`LatencyCurve` measured with ``loadgen``, that
curve's goodput, which is only the measured engine's (the notebook's: tiny-py on a CPU) whatever the model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from minipd.sim.costs import H100_SXM, DeviceSpec, count_parameters, kv_bytes_per_token, preset


@dataclass(frozen=True)
class LatencyCurve:
    """Latency percentiles measured at several offered rates (requests/s, increasing)."""

    rates: tuple[float, ...]
    p90_ttft_ms: tuple[float, ...]
    p90_tpot_ms: tuple[float, ...]

    def goodput(self, ttft_slo_ms: float, tpot_slo_ms: float) -> float:
        """The highest rate whose P90s meet both SLOs, interpolated linearly between measured rates
        (0 if even the lowest misses; the highest measured if none misses: a lower bound then)."""
        # At each rate, the worse of the two P90s as a share of its SLO: met while <= 1.
        excess = [max(ttft / ttft_slo_ms, tpot / tpot_slo_ms) for ttft, tpot in zip(self.p90_ttft_ms,
                                                                                     self.p90_tpot_ms, strict=True)]
        if not excess or excess[0] > 1:
            return 0.0
        for i in range(1, len(self.rates)):
            if excess[i] > 1:  # crossed between rates i - 1 and i: interpolate where it reaches 1
                lo, hi = excess[i - 1], excess[i]
                return self.rates[i - 1] + (1.0 - lo) / (hi - lo) * (self.rates[i] - self.rates[i - 1])
        return self.rates[-1]


@dataclass(frozen=True)
class Recommendation:
    """A deployment and why."""

    deployment: str
    reasons: list[str] = field(default_factory=list)
    #: Requests/s at the SLOs of the engine the curve was measured on (not ``model``), when a curve was given.
    predicted_goodput: float | None = None
    #: The numbers behind it, in GB: the weights, the KV cache of the requests in flight (0 when the weights
    #: alone decided), and one device's memory.
    weights_gb: float = 0.0
    kv_gb: float = 0.0
    device_gb: float = 0.0
    #: Chapter 05b's simulator at GPU scale for ``model`` and the workload (``simulate=True``).
    simulated: SimulatedGoodput | None = None


def recommend(model: str, prompt_tokens: int, output_tokens: int, rate: float, ttft_slo_ms: float = 500.0,
              tpot_slo_ms: float = 50.0, device_memory_gb: float = 80.0, weights_share: float = 0.8,
              long_prompt: int = 4096, curve: LatencyCurve | None = None, simulate: bool = False) -> Recommendation:
    """The article's guide for ``model`` (a :func:`minipd.sim.costs.preset` name, bf16 weights and cache) serving
    requests of ``prompt_tokens`` in and ``output_tokens`` out at ``rate`` requests/s on devices of
    ``device_memory_gb``; ``curve`` adds its (measured engine's) goodput; ``simulate`` asks chapter 05b's simulator
    for the goodput per GPU of a colocated instance and a split (H100s with ``device_memory_gb``), and lets it
    decide between them."""
    config = preset(model)
    params = count_parameters(config)
    weights_gb = params.total * 2 / 1e9
    memory = device_memory_gb * 1e9
    reasons = [f"{model}: {params.total / 1e9:.1f}B parameters ({params.active / 1e9:.1f}B active per token), "
               f"{weights_gb:.0f} GB of bf16 weights on a {device_memory_gb:.0f} GB device"]
    goodput = None if curve is None else curve.goodput(ttft_slo_ms, tpot_slo_ms)
    sim = simulate_goodput(model, prompt_tokens, output_tokens, ttft_slo_ms, tpot_slo_ms,
                           device_memory_gb=device_memory_gb) if simulate else None
    extra = {"simulated": sim}
    if weights_gb > weights_share * device_memory_gb:
        devices = int(-(-weights_gb // (weights_share * device_memory_gb)))
        if params.active < 0.5 * params.total:
            reasons.append(f"the weights need {devices}+ devices; each token uses {params.active / params.total:.0%} "
                           "of them, so shard the experts (expert parallelism) and keep attention replicated: "
                           "the experts, most of the bytes, divide by the devices (section 8's expert-sharding figure)")
            return Recommendation("MoE + expert sharding", reasons, goodput, weights_gb, 0.0, device_memory_gb,
                                  **extra)
        reasons.append(f"the weights need {devices}+ devices and every token uses all of them: tensor parallelism")
        return Recommendation("tensor parallel (dense, sharded)", reasons, goodput, weights_gb, 0.0, device_memory_gb,
                              **extra)
    kv_token = kv_bytes_per_token(config, 2)
    seconds_each = (ttft_slo_ms + output_tokens * tpot_slo_ms) / 1000  # at the SLOs: an upper bound in practice
    in_flight = rate * seconds_each  # Little's law
    kv_needed = in_flight * (prompt_tokens + output_tokens) * kv_token
    kv_room = memory - weights_gb * 1e9
    reasons.append(f"{in_flight:.0f} requests in flight (Little's law: {rate:g}/s × {seconds_each:.2f} s) hold "
                   f"{kv_needed / 1e9:.1f} GB of KV cache ({kv_token / 1024:.0f} KiB/token) against "
                   f"{kv_room / 1e9:.0f} GB left beside the weights")
    if kv_needed > kv_room:
        reasons.append(f"the cache of the requests in flight does not fit: split prefill and decode, and keep K/V "
                       f"in int8 (half of bf16's bytes: {kv_needed / 2e9:.1f} GB; chapter 06)")
        return Recommendation("PD split + KV compression", reasons, goodput, weights_gb, kv_needed / 1e9,
                              device_memory_gb, **extra)
    if sim is not None:
        split = sim.split > sim.colocated
        reasons.append(f"simulated on H100s at these SLOs (section 8's simulator figure): 1P+1D serves "
                       f"{sim.split:.1f} requests/s per GPU, one colocated instance {sim.colocated:.1f}")
    else:
        split = prompt_tokens >= long_prompt
        why = ("the simulator could not place this model and workload" if simulate
               else "simulate=True decides from the simulator instead")
        reasons.append(f"prompts {'of at least' if split else 'under'} {long_prompt} tokens (the article's rule of "
                       f"thumb; {why})")
    if split:
        reasons.append("long prefills stall the decode steps they share (section 5's ITL tails): split prefill and "
                       f"decode, and keep K/V in int8 (half of bf16's bytes: {kv_needed / 2e9:.1f} GB; chapter 06)")
        return Recommendation("PD split + KV compression", reasons, goodput, weights_gb, kv_needed / 1e9,
                              device_memory_gb, **extra)
    reasons.append("one dense instance: no KV transfer over the network, and no GPU waiting for the other phase")
    return Recommendation("one dense instance", reasons, goodput, weights_gb, kv_needed / 1e9, device_memory_gb,
                          **extra)


@dataclass(frozen=True)
class SimulatedGoodput:
    """Chapter 05b's cluster simulator at GPU scale: goodput per device of a colocated instance and of a
    1 prefill + 1 decode split, each instance on ``tp`` devices (the fewest that hold the weights and a KV
    cache), for one workload and its SLOs (90% of requests within both, DistServe's definition)."""

    colocated: float
    split: float
    tp: int
    device: str

    @property
    def best(self) -> str:
        return "PD split" if self.split > self.colocated else "colocated"


@functools.lru_cache(maxsize=256)  # deterministic: the explorer's sliders come back to values already simulated
def simulate_goodput(model: str, prompt_tokens: int, output_tokens: int, ttft_slo_ms: float = 500.0,
                     tpot_slo_ms: float = 50.0, device: DeviceSpec = H100_SXM, device_memory_gb: float | None = None,
                     num_requests: int = 16, duration_s: float = 15.0, rel_tol: float = 0.2) -> SimulatedGoodput | None:
    """Goodput per device (requests/s) of ``model`` serving ``prompt_tokens`` in and ``output_tokens`` out on
    ``device`` (its memory replaced by ``device_memory_gb`` if given), colocated and split, from
    :func:`minipd.sim.search.find_goodput` over :func:`minipd.sim.cluster.simulate` runs with the roofline step
    time (:class:`minipd.sim.roofline.RooflineStepTime`). Runs of ``duration_s`` of arrivals (at least
    ``num_requests``) and a coarse ``rel_tol`` keep one call to a few seconds, as a widget needs: a rough figure.
    15 s is shorter than :func:`minipd.sim.search.steady_duration` (130-300 s for chapter 08's examples, too
    slow for a slider) and long enough for the verdict: on those examples it gave the steady figures for chat
    (56 and 35 req/s per GPU) and at most 25% above them for 6,000-token documents (colocated 5.0 against 4.0 at a
    50 ms TPOT, 2.5 against 2.0 at 17.5 ms), where 1 s runs, the default before, gave up to 5x (20.0).
    None when a request does not fit the model's context or no tensor-parallel degree up to 64 fits.

    A mixture of experts is sharded as the simulator models every model, by tensor parallelism: the weights
    (every expert) spread evenly over the ``tp`` devices, each step reading the weights its tokens use."""
    from minipd.serve.loadgen import Slo
    from minipd.sim.cluster import simulate
    from minipd.sim.roofline import IB_400G
    from minipd.sim.search import GpuCluster, WorkloadShape, find_goodput

    config = preset(model)
    if prompt_tokens + output_tokens > config.max_position_embeddings:
        return None
    if device_memory_gb is not None:
        device = dataclasses.replace(device, memory_bytes=device_memory_gb * 1e9)
    cluster = GpuCluster(config, device, IB_400G)
    tp = next((tp for tp in (1, 2, 4, 8, 16, 32, 64) if cluster.fits(tp)), None)
    if tp is None:
        return None
    slo = Slo(ttft_ms=ttft_slo_ms, tpot_ms=tpot_slo_ms)
    shape = WorkloadShape(prompt_tokens, output_tokens, num_requests=num_requests, duration_s=duration_s)
    per_device: dict[str, float] = {}
    start = 4.0
    for kind, spec in (("colocated", cluster.colocated(1, tp)), ("split", cluster.disaggregated(1, tp, 1, tp))):
        rate, _ = find_goodput(lambda r, s=spec: simulate(s, shape.at(r), until_verdict=(slo, 0.9)).results(), slo,
                               start=start * spec.devices, rel_tol=rel_tol, max_runs=7)
        per_device[kind] = rate / spec.devices
        start = max(per_device[kind], 0.25)  # the split's search starts near the colocated goodput: fewer runs
    return SimulatedGoodput(per_device["colocated"], per_device["split"], tp, device.name)


__all__ = ["LatencyCurve", "Recommendation", "SimulatedGoodput", "recommend", "simulate_goodput"]
