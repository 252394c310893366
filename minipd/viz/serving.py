"""Plots for chapter 08: what a deployment's memory holds against one device, the simulator's goodput of
colocated and split serving, and the weights per device as experts are sharded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minipd.serve.guide import Recommendation, SimulatedGoodput


def plot_deployment(advice: Recommendation, ax: Any = None) -> Any:
    """The weights and the KV cache of the requests in flight as stacked bars (GB, log scale), against one
    device's memory (the dashed line), titled with the deployment the guide recommends."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 2.2), layout="constrained")
    ax.barh([0], [advice.weights_gb], color="tab:gray", label="weights (bf16)")
    ax.barh([0], [max(advice.kv_gb, 1e-3)], left=[advice.weights_gb], color="tab:orange",
            label="KV cache of the requests in flight")
    ax.axvline(advice.device_gb, color="k", ls="--", label=f"one device ({advice.device_gb:.0f} GB)")
    ax.set_xscale("log")
    ax.set_xlim(1, max(advice.weights_gb + advice.kv_gb, advice.device_gb) * 2)
    ax.set_yticks([])
    ax.set_xlabel("GB")
    ax.set_title(f"recommended: {advice.deployment}")
    ax.legend(fontsize="small", frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax


def plot_simulated_goodput(examples: dict[str, SimulatedGoodput], recommended: dict[str, str] | None = None,
                           ax: Any = None) -> Any:
    """Chapter 05b's simulated goodput per GPU (requests/s, log scale) of one colocated instance and of a
    1 prefill + 1 decode split for each labelled workload; the guide's recommendation under each label."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6), layout="constrained")
    labels = list(examples)
    x = np.arange(len(labels))
    for offset, kind, color in ((-0.2, "colocated", "tab:blue"), (0.2, "split", "tab:orange")):
        values = [getattr(examples[k], kind) for k in labels]
        bars = ax.bar(x + offset, values, 0.4, color=color,
                      label={"colocated": "one colocated instance", "split": "1 prefill + 1 decode"}[kind])
        ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize="small")
    names = [k.replace(", ", "\n") + f" (tp={examples[k].tp})" + (f"\n→ {recommended[k]}" if recommended else "")
             for k in labels]
    ax.set_xticks(x, names, fontsize="small")
    ax.set_yscale("log")
    ax.set_ylabel("goodput per GPU (requests/s)")
    ax.legend(fontsize="small", frameon=False)
    ax.set_title(f"simulated (chapter 05b, roofline on {next(iter(examples.values())).device}): "
                 "90% of requests within both SLOs")
    return ax


def plot_expert_sharding(model: str, device_gb: float = 80.0, weights_share: float = 0.8,
                         ax: Any = None) -> tuple[Any, int | None]:
    """bf16 weights per device (GB) against the expert-parallel size: attention, embeddings and norms
    replicated on every device, the MLP parameters (the experts) divided among them; the dashed line is the
    share of a device left for weights (``weights_share × device_gb``). Returns the axes and the smallest size
    whose weights fit."""
    import matplotlib.pyplot as plt

    from minipd.sim.costs import count_parameters, preset

    params = count_parameters(preset(model))
    replicated = (params.total - params.mlp) * 2 / 1e9
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    per_device = [replicated + params.mlp * 2 / 1e9 / n for n in sizes]
    fits = next((n for n, gb in zip(sizes, per_device, strict=True) if gb <= weights_share * device_gb), None)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    ax.plot(sizes, per_device, "-o", label="weights per device")
    ax.axhline(replicated, color="tab:gray", ls=":", label=f"replicated part ({replicated:.0f} GB)")
    ax.axhline(weights_share * device_gb, color="k", ls="--",
               label=f"{weights_share:.0%} of a {device_gb:.0f} GB device")
    if fits is not None:
        ax.axvline(fits, color="tab:green", alpha=0.5, label=f"fits from {fits} devices")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("expert-parallel size (devices)")
    ax.set_ylabel("bf16 weights per device (GB)")
    ax.set_title(f"{model}: sharding the experts", fontsize="medium")
    ax.legend(fontsize="small", frameon=False)
    return ax, fits


__all__ = ["plot_deployment", "plot_expert_sharding", "plot_simulated_goodput"]
