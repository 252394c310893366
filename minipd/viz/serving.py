"""Plots for chapter 08: what a deployment's memory holds, against one device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minipd.serve.guide import Recommendation


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


__all__ = ["plot_deployment"]
