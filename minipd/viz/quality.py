"""A widget to pick a KV compression method and budget and watch the quality measures move.

It runs :func:`minipd.evaluation.kv_quality.measure` (one window, one greedy prompt, two copy probes: a few
seconds) whenever the choice changes. ipywidgets and matplotlib are imported inside the function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: What the method menu offers: quantized formats, then presses (which take the budget).
QUANT_METHODS = ("int8", "fp8", "int4_per_token", "int4")
PRESS_METHODS = ("sink-window", "snapkv", "h2o", "knorm", "random")


def method_name(method: str, budget: int, int8_on_top: bool) -> str:
    """The :func:`~minipd.evaluation.kv_quality.method_options` name for a menu choice: ``"int8"``, ``"snapkv:64"``,
    ``"int8+snapkv:64"``."""
    if method in QUANT_METHODS:
        return method
    press = f"{method}:{budget}"
    return f"int8+{press}" if int8_on_top else press


def quality_explorer(model: str = "tiny-py", window: int = 256) -> Any:
    """A method menu, a budget slider (for presses) and an "int8 on top" box; below them the quality table
    of the choice against the uncompressed cache, and bars of its bytes and perplexity change."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from minipd.evaluation.kv_quality import format_table, measure
    from minipd.viz.explorer import explorer_box

    # A press first: its budget slider is live from the start (a quantized format has no budget).
    method = widgets.Dropdown(options=[*QUANT_METHODS, *PRESS_METHODS], value=PRESS_METHODS[0], description="method")
    budget = widgets.IntSlider(value=64, min=32, max=window - 16, step=16, description="budget",
                               continuous_update=False)
    on_top = widgets.Checkbox(value=False, description="int8 on top (presses)")
    out = widgets.Output()
    history: list[Any] = []

    def draw(_change: object = None) -> None:
        budget.disabled = on_top.disabled = method.value in QUANT_METHODS
        name = method_name(method.value, budget.value, on_top.value)
        with out:
            out.clear_output(wait=True)
            print(f"measuring {name} ...")
            reports = measure(model, [name], window=window, num_windows=1, greedy_prompts=1, greedy_tokens=32,
                              num_probes=2, progress=False)
            history[:] = [*[r for r in history if r.method != name][-5:], reports[-1]]
            out.clear_output(wait=True)
            print(format_table(reports))
            fig, axes = plt.subplots(1, 2, figsize=(9, 2.6), layout="constrained")
            names = [r.method for r in history]
            axes[0].barh(names, [r.bytes_vs_fp16 for r in history], color="tab:blue")
            axes[0].set_xlabel("bytes per token vs fp16")
            axes[1].barh(names, [100 * r.perplexity_change for r in history], color="tab:orange")
            axes[1].set_xlabel("perplexity change (%)")
            axes[1].set_yticks([])
            fig.suptitle("your last choices")
            plt.show()

    for control in (method, budget, on_top):
        control.observe(draw, names="value")
    draw()

    explorer = explorer_box([widgets.HBox([method, budget, on_top]), out], "KV quality explorer",
                            "the tables above are the static version")
    explorer.reports = history  # the last choices' QualityReports, newest last
    return explorer


def plot_quality_vs_bytes(reports: Sequence[Any], ax: Any = None) -> Any:
    """Each measured KV format or press as a point: bytes per token against an fp16 cache, and the greedy tokens
    equal to full precision; the static counterpart of :func:`quality_explorer`."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
    for r in reports:
        evicts = r.kept < 1.0
        ax.scatter(r.bytes_vs_fp16, 100 * r.greedy_equal, marker="o" if evicts else "s",
                   color="tab:orange" if evicts else "tab:blue", s=45)
        ax.annotate(r.method, (r.bytes_vs_fp16, 100 * r.greedy_equal), textcoords="offset points", xytext=(5, 3),
                    fontsize=8)
    ax.set(xscale="log", xlabel="KV bytes per token / an fp16 cache's (log)", ylim=(0, 105),
           ylabel="greedy tokens equal to full precision (%)",
           title="what each format (squares) and press (circles) keeps, and what it costs")
    return ax
