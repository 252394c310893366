"""Calibrating the roofline to a paper's engine: the fit meets the figures it was fitted to, and DistServe's
Figure 1 is reproduced by the two figures it was not fitted to."""

from __future__ import annotations

import dataclasses

import pytest

from minipd.sim.calibrate import DISTSERVE_FIGURE_1, _bisect, calibrate
from minipd.sim.costs import A100_80GB, preset
from minipd.sim.roofline import DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY, NVLINK3
from minipd.sim.search import GpuCluster


@pytest.mark.parametrize("edge", [0.031, 0.34, 0.97])
def test_the_bisection_finds_the_least_efficiency_that_meets_to_its_resolution(edge):
    calls = []

    def meets_at(efficiency: float) -> bool:
        calls.append(efficiency)
        return efficiency >= edge

    found = _bisect(meets_at, iterations=12)
    assert meets_at(found) and edge <= found <= edge * (1.0 / 0.02) ** (1 / 2 ** 12)
    assert len(calls) == 13


def test_the_bisection_answers_its_upper_end_when_nothing_meets():
    assert _bisect(lambda _: False, iterations=5) == 1.0


def test_the_cluster_passes_its_efficiencies_to_every_step_model():
    cluster = GpuCluster(preset("opt-13b"), A100_80GB, NVLINK3)
    assert cluster.step_model(2).compute_efficiency == DEFAULT_COMPUTE_EFFICIENCY
    slow = dataclasses.replace(cluster, compute_efficiency=0.3, memory_efficiency=0.4, step_overhead_s=0.002)
    model = slow.step_model(2)
    assert (model.compute_efficiency, model.memory_efficiency, model.step_overhead_s) == (0.3, 0.4, 0.002)
    assert cluster.step_model(1).memory_efficiency == DEFAULT_MEMORY_EFFICIENCY


def test_distserve_figure_1_fitted_on_its_single_phase_figures_reproduces_its_colocated_and_split_figures():
    """Fitted to prefill-only 5.6 and decode-only 10 req/s (runs at steady state: 59 s of arrivals), the simulated
    colocated GPU (as vLLM scheduled in 2023) and 2P+1D land within 12% and 10% of the paper's 1.6 and 3.3 req/s
    per GPU (1.77 and 3.35 when written), and the split's advantage within 15% of the paper's 2.1x. With today's
    default efficiencies every figure is at least twice the paper's."""
    vllm_2023 = GpuCluster(preset("opt-13b"), A100_80GB, NVLINK3, colocated_policy="prefill-only",
                           colocated_batched_tokens=2560)
    fit = calibrate(vllm_2023, rounds=1)  # matches the stored two-round fit: the second changes nothing here
    figures = DISTSERVE_FIGURE_1
    assert fit.prefill_only == pytest.approx(figures.prefill_only, rel=0.05)
    assert fit.decode_only == pytest.approx(figures.decode_only, rel=0.05)
    assert fit.colocated == pytest.approx(figures.colocated, rel=0.12)
    assert fit.split_per_device == pytest.approx(figures.split_per_device, rel=0.10)
    ratio, paper = fit.split_per_device / fit.colocated, figures.split_per_device / figures.colocated
    assert ratio == pytest.approx(paper, rel=0.15)
    assert 0.2 < fit.cluster.compute_efficiency < DEFAULT_COMPUTE_EFFICIENCY
    assert 0.2 < fit.cluster.memory_efficiency < DEFAULT_MEMORY_EFFICIENCY
    assert "published 1.6 req/s" in fit.describe() and len(fit.rows()) == 4


def test_calibration_leaves_out_the_clusters_control_latency():
    """A paper's figures hold its engine's own messages: latency given to the cluster is not fitted away."""
    quick = {"num_requests": 40, "duration_s": 4.0, "iterations": 3, "rounds": 1}
    plain = calibrate(GpuCluster(preset("opt-13b"), A100_80GB, NVLINK3), **quick)
    late = calibrate(GpuCluster(preset("opt-13b"), A100_80GB, NVLINK3, dispatch_latency_s=0.05,
                                output_latency_s=0.05), **quick)
    assert late.cluster.dispatch_latency_s == late.cluster.output_latency_s == 0.0
    assert (late.cluster.compute_efficiency, late.cluster.memory_efficiency) == (
        plain.cluster.compute_efficiency, plain.cluster.memory_efficiency)


def test_bad_calibration_arguments_are_refused():
    cluster = GpuCluster(preset("opt-13b"), A100_80GB, NVLINK3)
    with pytest.raises(ValueError, match="rounds and iterations"):
        calibrate(cluster, rounds=0)
