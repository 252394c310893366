"""Making the simulated engine as fast as a paper's: the roofline's efficiencies fitted to published goodputs.

Whether disaggregation pays depends on how an engine's step times compare with the SLOs: against a lax TPOT
objective a colocated engine's prefill interruptions cost nothing, against a tight one they cost everything.
The roofline's default efficiencies (60% of peak FLOP/s, 80% of HBM bandwidth, 1 ms a step) describe a
well-tuned engine of today; a paper's figures come from its own engine, sometimes several times slower. To
reproduce a paper, make the simulated engine as fast as the paper's first, from figures the paper gives.

DistServe's Figure 1 gives exactly what that takes (:data:`DISTSERVE_FIGURE_1`): for a 13B model on one A100
80GB (512-token prompts, 64-token answers, Poisson arrivals, P90 TTFT ≤ 0.4 s and P90 TPOT ≤ 0.04 s), the
goodput of the GPU running **prefill only** (5.6 req/s) and **decode only** (10 req/s) — one figure per phase,
to fit the two efficiencies to — and of the GPU **colocated** (1.6 req/s) and of **2 prefill + 1 decode** GPUs
(3.3 req/s per GPU): two figures left over to check the fit against.

:func:`calibrate` bisects the compute efficiency until a prefill-only instance's simulated goodput matches the
published one, then the memory efficiency for a decode-only instance, and repeats once (a prefill also writes
K/V and a decode step also computes, so each efficiency moves the other phase a little). The per-step overhead
stays as given: two figures fit two numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from minipd.serve.loadgen import Slo
from minipd.sim.cluster import ClusterSpec, simulate
from minipd.sim.costs import A100_80GB, DeviceSpec, preset
from minipd.sim.search import GpuCluster, WorkloadShape, placement_goodput, steady_duration


@dataclass(frozen=True)
class PublishedFigures:
    """Goodputs (requests/s) a paper reports for one kind of device and one workload: two single-phase ones to
    fit a step model to, two with both phases to check it against."""

    source: str
    #: The model (a :data:`~minipd.sim.costs.MODEL_PRESETS` name) and device the figures were measured on.
    model: str
    device: DeviceSpec
    prompt_len: int
    output_len: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    #: One device running prefill only, judged on TTFT alone.
    prefill_only: float
    #: One device running decode only, judged on TPOT alone.
    decode_only: float
    #: One device running both phases, judged on both.
    colocated: float
    #: Prefill and decode devices of the disaggregated placement the paper reports, and its goodput per device.
    split: tuple[int, int]
    split_per_device: float


#: DistServe (Zhong et al., OSDI'24), Figure 1: a 13B model on one NVIDIA A100 80GB, input 512 and output 64
#: tokens, Poisson arrivals, P90 TTFT 0.4 s and P90 TPOT 0.04 s.
DISTSERVE_FIGURE_1 = PublishedFigures(
    source="DistServe (OSDI'24) Figure 1: a 13B model on one A100 80GB, 512 in / 64 out",
    model="opt-13b", device=A100_80GB, prompt_len=512, output_len=64, ttft_slo_ms=400.0, tpot_slo_ms=40.0,
    prefill_only=5.6, decode_only=10.0, colocated=1.6, split=(2, 1), split_per_device=3.3)


#: DistServe's chatbot lengths, as two distributions :func:`minipd.serve.workload.draw_lengths` draws from
#: (prompt, output). Fitted to the 1,850 requests of the vLLM runs DistServe released with its simulator
#: (LLMServe/DistServe, ``simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt``, commit
#: 20a1633): prompts mean 780, median 756, p10 94, p90 1,515, at most 2,003 tokens; outputs mean 174, median
#: 68, p10 8, p90 478, at most 1,085. These draws: prompts mean 800, median 799, p10 162, p90 1,441; outputs
#: mean 169, median 66, p10 9, p90 476. Long prompts and short answers: far from uniform 64-1024 / 32-512.
DISTSERVE_SHAREGPT_LENGTHS = ("2:1600", "lognormal:220:1.55:1085")

#: The same released runs, summarised (OPT-13B on A100s, the lengths above, Poisson arrivals, 100 s of them):
#: per engine, (rate req/s, requests, share meeting TTFT ≤ 250 ms and TPOT ≤ 100 ms, P50 TTFT ms, P50 TPOT ms).
#: vLLM (2023) on one GPU; DistServe as one prefill instance on two GPUs (tensor parallel) and one decode
#: instance on one ("c21d11"), three GPUs.
DISTSERVE_RELEASED_RUNS: dict[str, list[tuple[float, int, float, float, float]]] = {
    "vLLM 1C": [(1.0, 100, 0.860, 146, 31.2), (1.5, 150, 0.847, 146, 41.9), (2.0, 200, 0.665, 183, 61.6),
                (2.5, 250, 0.780, 154, 62.6), (3.0, 300, 0.340, 230, 96.1), (3.5, 350, 0.254, 288, 100.5)],
    "DistServe 1P(tp2)+1D": [(3.0, 300, 0.983, 82, 38.7), (4.5, 450, 0.960, 86, 53.1), (6.0, 600, 0.647, 98, 75.8),
                             (7.5, 750, 0.335, 109, 138.6), (9.0, 900, 0.212, 168, 214.4)],
}


@dataclass
class Calibration:
    """A cluster whose roofline runs as fast as the paper's engine, and the four figures beside the paper's."""

    cluster: GpuCluster
    figures: PublishedFigures
    prefill_only: float
    decode_only: float
    colocated: float
    split_per_device: float

    def rows(self) -> list[tuple[str, float, float]]:
        """(figure, published, simulated) for the two fitted figures, then the two checks."""
        f = self.figures
        prefill, decode = f.split
        return [("prefill only (fitted)", f.prefill_only, self.prefill_only),
                ("decode only (fitted)", f.decode_only, self.decode_only),
                ("colocated (check)", f.colocated, self.colocated),
                (f"{prefill}P+{decode}D per device (check)", f.split_per_device, self.split_per_device)]

    def describe(self) -> str:
        """The fitted efficiencies and a line per figure, published against simulated."""
        lines = [f"{self.figures.source}: compute {self.cluster.compute_efficiency:.1%} and memory "
                 f"{self.cluster.memory_efficiency:.1%} of peak, {self.cluster.step_overhead_s * 1e3:g} ms a step"]
        lines += [f"  {name}: published {paper:g} req/s, simulated {ours:.2f} ({ours / paper:.2f}x)"
                  for name, paper, ours in self.rows()]
        return "\n".join(lines)


def _goodput(spec: ClusterSpec, shape: WorkloadShape, slo: Slo, start: float, rel_tol: float) -> float:
    return placement_goodput(spec, shape, slo, start=start, rel_tol=rel_tol)[0]


def _meets(spec: ClusterSpec, shape: WorkloadShape, slo: Slo, rate: float) -> bool:
    """Whether ``spec`` serves ``rate`` within ``slo`` (90% attainment): one simulation, where a goodput
    search takes several. Goodput ≥ rate exactly when this holds, attainment falling as the rate grows."""
    return simulate(spec, shape.at(rate), until_verdict=(slo, 0.9)).attainment(slo) >= 0.9


# A prefill-only device is judged on TTFT alone: four decode instances, so that the decode side never limits
# it; a decode-only device on TPOT alone, fed by four prefill instances, faster than it can serve.
def _prefill_only(cluster: GpuCluster) -> ClusterSpec:
    return cluster.disaggregated(1, 1, 4, 1)


def _decode_only(cluster: GpuCluster) -> ClusterSpec:
    return cluster.disaggregated(4, 1, 1, 1)


def _bisect(meets_at: Callable[[float], bool], low: float = 0.02, high: float = 1.0, iterations: int = 10) -> float:
    """The least efficiency in ``[low, high]`` at which ``meets_at`` holds (it holds from some efficiency up),
    bisected on a log scale to ``(high / low) ** (1 / 2**iterations)``; ``high`` if it never holds."""
    for _ in range(iterations):
        middle = math.sqrt(low * high)
        low, high = (low, middle) if meets_at(middle) else (middle, high)
    return high


def calibrate(cluster: GpuCluster, figures: PublishedFigures = DISTSERVE_FIGURE_1, num_requests: int = 200,
              duration_s: float | None = None, rel_tol: float = 0.02, iterations: int = 10, rounds: int = 2,
              seed: int = 0, progress: bool = False) -> Calibration:
    """``cluster`` on ``figures``' model and device, its compute and memory efficiencies fitted so that one
    device's simulated prefill-only and decode-only goodputs match ``figures``, and the colocated and split
    goodputs the fit then gives. ``cluster``'s scheduling, limits and link are kept, its control latency is not
    (set to 0: the paper's figures hold their own); to run another model or device as efficiently, copy the two
    efficiencies onto its cluster.

    Runs ``rounds × 2`` bisections of ``iterations`` steps, each step one simulation at the published rate
    (``num_requests`` requests or ``duration_s`` seconds of arrivals, whichever is more; by default
    :func:`~minipd.sim.search.steady_duration` of the figures' answers and SLOs, 59 s for Figure 1), then a goodput
    search (to ``rel_tol``) for each of the four figures. The colocated figure uses ``cluster``'s colocated
    scheduling policy (DistServe's baseline: ``"prefill-only"``).
    """
    if rounds < 1 or iterations < 1:
        raise ValueError(f"rounds and iterations must be >= 1, got {rounds} and {iterations}")
    if duration_s is None:
        duration_s = steady_duration(figures.output_len, Slo(figures.ttft_slo_ms, figures.tpot_slo_ms))
    shape = WorkloadShape(figures.prompt_len, figures.output_len, num_requests, seed=seed, duration_s=duration_s)
    # (The published figures come with their engine's own control messages inside them: none added on top.)
    cluster = dataclasses.replace(cluster, model=preset(figures.model), device=figures.device, dispatch_latency_s=0.0,
                                  output_latency_s=0.0)
    steps = range(rounds)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="calibrating", unit="round", leave=False)
    ttft, tpot = Slo(ttft_ms=figures.ttft_slo_ms), Slo(tpot_ms=figures.tpot_slo_ms)
    for _ in steps:
        compute = _bisect(lambda c, base=cluster: _meets(_prefill_only(dataclasses.replace(base, compute_efficiency=c)),
                                                         shape, ttft, figures.prefill_only), iterations=iterations)
        cluster = dataclasses.replace(cluster, compute_efficiency=compute)
        memory = _bisect(lambda m, base=cluster: _meets(_decode_only(dataclasses.replace(base, memory_efficiency=m)),
                                                        shape, tpot, figures.decode_only), iterations=iterations)
        cluster = dataclasses.replace(cluster, memory_efficiency=memory)
    both = Slo(figures.ttft_slo_ms, figures.tpot_slo_ms)
    prefill, decode = figures.split
    split = _goodput(cluster.disaggregated(prefill, 1, decode, 1), shape, both,
                     figures.split_per_device * (prefill + decode), rel_tol)
    return Calibration(cluster, figures,
                       prefill_only=_goodput(_prefill_only(cluster), shape, ttft, figures.prefill_only, rel_tol),
                       decode_only=_goodput(_decode_only(cluster), shape, tpot, figures.decode_only, rel_tol),
                       colocated=_goodput(cluster.colocated(1, 1), shape, both, figures.colocated, rel_tol),
                       split_per_device=split / (prefill + decode))


__all__ = ["DISTSERVE_FIGURE_1", "DISTSERVE_RELEASED_RUNS", "DISTSERVE_SHAREGPT_LENGTHS", "Calibration",
           "PublishedFigures", "calibrate"]
