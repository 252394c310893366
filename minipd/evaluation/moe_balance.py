"""How unevenly a MoE model loads its experts, and what capping the load costs: ``python -m minipd moebalance``.

:func:`measure_load` runs held-out text through a MoE model with ``record_routing`` and sums each
layer's tokens per expert. Imbalance is read two ways: the hottest expert's load over the mean (what
sets the pace when every expert sits on its own device) and the coefficient of variation.

:func:`format_placement_table` places the experts on devices from that load, with and without
replicas of the hot ones (:mod:`minipd.moe.placement`). :func:`capacity_table` caps the load
(:mod:`minipd.moe.capacity`) at a few factors, dropping or rerouting the overflow, and prices each
setting with :mod:`minipd.evaluation.kv_quality`'s measures against unconstrained routing: perplexity change,
KL of next-token distributions, greedy agreement. :func:`quantized_routing_table` does the same for
gates rounded to int8/int4 and dispatched rows rounded to int8/fp8, with the share of top-k sets a
quantized gate keeps and the bytes a token's dispatch moves.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoadReport:
    """Tokens per expert in every MoE layer, over the text measured."""

    #: (layers, experts) assignments.
    counts: torch.Tensor

    @property
    def max_over_mean(self) -> list[float]:
        """Per layer: the hottest expert's load over the mean load (1.0 is perfectly even)."""
        c = self.counts.float()
        return (c.max(dim=1).values / c.mean(dim=1)).tolist()

    @property
    def coefficient_of_variation(self) -> list[float]:
        """Per layer: the standard deviation of the loads over their mean."""
        c = self.counts.float()
        return (c.std(dim=1, unbiased=False) / c.mean(dim=1)).tolist()


def measure_load(model: str = "tiny-py-moe", window: int = 256, num_windows: int = 4, **options: Any) -> LoadReport:
    """Route ``num_windows`` held-out windows through ``model`` (engine ``options`` too) and count."""
    from minipd import LLM, SamplingParams
    from minipd.evaluation.kv_quality import windows

    llm = LLM(model, record_routing=True, enable_prefix_caching=False, **options)
    total = None
    for ids in windows(llm.tokenizer, window, num_windows):
        llm.engine.core.step_stats.clear()
        llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
        for stats in llm.engine.core.step_stats:
            counts = torch.tensor(stats.expert_counts)
            total = counts if total is None else total + counts
    if total is None:
        raise ValueError(f"{model} recorded no routing: is it a mixture-of-experts model?")
    return LoadReport(total)


#: The capacity settings compared by default: (name, engine options).
CAPACITY_SETTINGS: dict[str, dict[str, Any]] = {
    f"cap {factor} {policy}": {"moe_capacity_factor": factor, "moe_overflow": policy}
    for factor in (1.0, 1.5, 2.0) for policy in ("drop", "reroute")
}


def capacity_table(model: str = "tiny-py-moe", settings: dict[str, dict[str, Any]] | None = None,
                   num_windows: int = 4, progress: bool = True) -> list[tuple[str, Any, LoadReport]]:
    """For unconstrained routing (``"auto"``) and each capacity setting: the quality report and the load."""
    from minipd.evaluation.kv_quality import measure

    settings = settings or CAPACITY_SETTINGS
    reports = measure(model, list(settings), num_windows=num_windows, greedy_prompts=2, greedy_tokens=64,
                      num_probes=2, options=settings, progress=progress)
    loads = {"auto": measure_load(model, num_windows=num_windows)}
    loads |= {name: measure_load(model, num_windows=num_windows, **options) for name, options in settings.items()}
    return [(r.method, r, loads[r.method]) for r in reports]


def format_capacity_table(rows: Sequence[tuple[str, Any, LoadReport]]) -> str:
    """One line per setting: load imbalance (mean over layers) and the quality measures."""
    lines = [f"{'routing':>18} {'max/mean':>9} {'CV':>6} {'Δppl':>8} {'KL':>9} {'greedy=':>8} {'equal':>6}"]
    for name, report, load in rows:
        lines.append(f"{name:>18} {statistics.mean(load.max_over_mean):9.2f} "
                     f"{statistics.mean(load.coefficient_of_variation):6.2f} {100 * report.perplexity_change:+7.2f}% "
                     f"{report.mean_kl:9.2e} {report.greedy_prefix:8.1f} {report.greedy_equal:6.1%}")
    return "\n".join(lines)


#: Quantized routing and dispatch settings compared by default: (name, engine options).
QUANTIZED_ROUTING: dict[str, dict[str, Any]] = {
    "gate int8": {"router_dtype": "int8"},
    "gate int4": {"router_dtype": "int4"},
    "dispatch int8": {"moe_dispatch_dtype": "int8"},
    "dispatch fp8": {"moe_dispatch_dtype": "fp8"},
    "gate int4 + dispatch fp8": {"router_dtype": "int4", "moe_dispatch_dtype": "fp8"},
}


def routing_agreement(model: str, weight_format: str | None, window: int = 256, num_windows: int = 4) -> float:
    """Share of (token, layer) top-k sets a quantized gate leaves unchanged, on the unquantized model's own
    hidden states (so upstream drift does not count twice)."""
    from minipd import LLM, SamplingParams
    from minipd.evaluation.kv_quality import windows

    llm = LLM(model, enable_prefix_caching=False)
    layers = llm.engine.core.moe_layers
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.register_forward_pre_hook(lambda _m, args, i=i: inputs[i].append(args[0].detach()))
             for i, layer in enumerate(layers)]
    try:
        for ids in windows(llm.tokenizer, window, num_windows):
            llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    same = total = 0
    with torch.no_grad():
        for layer, seen in zip(layers, inputs, strict=True):
            hidden = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])
            router = layer.router
            _, exact = router(hidden)
            router.weight_format = weight_format
            try:
                _, rounded = router(hidden)
            finally:
                router.weight_format = None
            same += int((exact.sort(-1).values == rounded.sort(-1).values).all(-1).sum())
            total += hidden.shape[0]
    return same / total


def dispatch_bytes_per_token(model: str, dispatch_dtype: str = "auto") -> int:
    """Bytes one token sends to its experts in one MoE layer's dispatch (its top-k copies of the hidden
    state; a scale per copy when quantized); the combine brings as many back in the model's dtype."""
    from minipd.config import ModelConfig
    from minipd.models import resolve_model

    cfg = ModelConfig.from_pretrained(resolve_model(model))
    element = {"auto": 4, "int8": 1, "fp8": 1}[dispatch_dtype]  # the bundled models compute in fp32
    scale = 0 if dispatch_dtype == "auto" else 2
    return cfg.num_experts_per_tok * (cfg.hidden_size * element + scale)


def quantized_routing_table(model: str = "tiny-py-moe", settings: dict[str, dict[str, Any]] | None = None,
                            num_windows: int = 4, progress: bool = True) -> str:
    """Routing agreement, output drift (quality measures) and dispatch bytes per token, per setting."""
    from minipd.evaluation.kv_quality import measure

    settings = settings or QUANTIZED_ROUTING
    reports = measure(model, list(settings), num_windows=num_windows, greedy_prompts=2, greedy_tokens=64,
                      num_probes=2, options=settings, progress=progress)
    lines = [f"{'routing':>26} {'top-k same':>10} {'Δppl':>8} {'KL':>9} {'greedy=':>8} {'dispatch B/token':>16}"]
    for report in reports:
        options = settings.get(report.method, {})
        agreement = routing_agreement(model, options.get("router_dtype"), num_windows=num_windows) \
            if options.get("router_dtype") else 1.0
        sent = dispatch_bytes_per_token(model, options.get("moe_dispatch_dtype", "auto"))
        lines.append(f"{report.method:>26} {agreement:10.1%} {100 * report.perplexity_change:+7.2f}% "
                     f"{report.mean_kl:9.2e} {report.greedy_prefix:8.1f} {sent:16d}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m minipd moebalance [--model M] [--windows N]``: per-layer imbalance, then the capacity table."""
    parser = argparse.ArgumentParser(prog="python -m minipd moebalance", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-py-moe")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows of 256 tokens")
    parser.add_argument("--train", type=int, default=0, metavar="STEPS",
                        help="instead: fine-tune the routers for STEPS steps with each balancing method "
                             "(none, aux loss, loss-free bias) and compare")
    parser.add_argument("--plot", default=None, help="with --train: save the curves to this image file")
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error("--windows must be at least 1")
    if args.train < 0:
        parser.error("--train must be a positive number of steps")
    if args.train:
        return _train(args.model, args.train, args.plot)
    load = measure_load(args.model, num_windows=args.windows)
    print(f"[moebalance] {args.model}, {args.windows} held-out windows of 256 tokens")
    for layer, (ratio, cv) in enumerate(zip(load.max_over_mean, load.coefficient_of_variation, strict=True)):
        print(f"  layer {layer}: hottest expert {ratio:.2f}x the mean load, CV {cv:.2f}, loads "
              f"{load.counts[layer].tolist()}")
    print(format_placement_table(load))
    print(format_capacity_table(capacity_table(args.model, num_windows=args.windows)))
    print("  quantized routing and dispatch (top-k same: on the full-precision model's own hidden states)")
    print(quantized_routing_table(args.model, num_windows=args.windows))
    return 0


def format_placement_table(load: LoadReport, num_devices: int = 4) -> str:
    """Per layer: the most loaded of ``num_devices`` devices over the mean, for experts in order and for
    placements from the measured load with 0 and ``num_devices`` replicas (:mod:`minipd.moe.placement`)."""
    from minipd.moe.placement import contiguous_placement, imbalance, place_experts

    experts = load.counts.shape[1]
    lines = [f"  expert placement on {num_devices} devices (max device load / mean): in order, measured, "
             f"measured + {num_devices} replicas"]
    for layer, counts in enumerate(load.counts.tolist()):
        ratios = [imbalance(contiguous_placement(experts, num_devices), counts),
                  imbalance(place_experts(counts, num_devices), counts),
                  imbalance(place_experts(counts, num_devices, redundant=num_devices), counts)]
        lines.append(f"  layer {layer}: " + "  ".join(f"{r:.2f}x" for r in ratios))
    return "\n".join(lines)


def _train(model: str, steps: int, plot: str | None) -> int:
    from minipd.evaluation.router_training import METHODS, finetune_routers, plot_balancing

    runs = [finetune_routers(method, model, steps=steps) for method in METHODS]
    print(f"[moebalance --train] {model}, routers only, {steps} steps of 4 x 128 tokens of stdlib source")
    print(f"  {'method':>6} {'held-out loss':>22} {'max/mean load (mean of layers)':>32}")
    for run in runs:
        (l0, l1), (i0, i1) = run.heldout_loss, run.heldout_imbalance
        print(f"  {run.method:>6} {l0:10.4f} -> {l1:8.4f} {i0:18.2f} -> {i1:9.2f}")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plot_balancing(runs)
        plt.savefig(plot, dpi=120)
        print(f"  curves saved to {plot}")
    return 0
