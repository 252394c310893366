"""Disaggregated serving drawn from measured events: a request's prefill layers and its K/V transfer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minipd.outputs import RequestOutput


def plot_kv_timelines(outputs: Mapping[str, RequestOutput], axes: Any = None) -> Any:
    """One row per transfer mode: the prefill step's layers, the writes the prefill worker posted, the
    transfer's span, and the first two tokens, in milliseconds from the start of the prefill step.

    ``outputs`` maps a label (the mode) to a finished ``RequestOutput`` of ``DisaggregatedLLM`` whose
    ``metrics.kv_timeline`` is set. Returns the array of Axes.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(len(outputs), 1, figsize=(11, 1.25 * len(outputs) + 0.8), sharex=True,
                               layout="constrained", squeeze=False)
        axes = axes[:, 0]
    rows = {"prefill layers": 2, "writes posted": 1, "K/V in flight": 0}
    for ax, (label, output) in zip(axes, outputs.items(), strict=True):
        timeline = output.metrics.kv_timeline
        if timeline is None or timeline.prefill_step is None:
            raise ValueError(f"outputs[{label!r}] has no measured kv_timeline (not a disaggregated request?)")
        start = timeline.prefill_step[0]

        def ms(t: float, start: float = start) -> float:
            return (t - start) * 1e3

        for i, (a, b) in enumerate(timeline.layers):
            ax.broken_barh([(ms(a), ms(b) - ms(a))], (rows["prefill layers"] - 0.35, 0.7),
                           color=("tab:blue", "lightsteelblue")[i % 2])
            ax.text((ms(a) + ms(b)) / 2, rows["prefill layers"], str(i), ha="center", va="center", fontsize=7)
        for _, a, b in timeline.sends:
            ax.broken_barh([(ms(a), max(ms(b) - ms(a), 0.3))], (rows["writes posted"] - 0.35, 0.7), color="tab:orange")
        if timeline.transfer is not None:
            a, b = timeline.transfer
            ax.broken_barh([(ms(a), ms(b) - ms(a))], (rows["K/V in flight"] - 0.2, 0.4), color="tab:green")
        times = output.metrics.token_times
        for n, t in enumerate(times[:2]):
            ax.axvline(ms(t), color="0.3", ls="--" if n else "-", lw=1)
            ax.text(ms(t), 2.55, ("1st token", "2nd token")[n], fontsize=8, ha="center")
        ax.set_yticks(list(rows.values()), list(rows))
        ax.set_ylim(-0.6, 2.9)
        ax.set_title(label, loc="left", fontsize=10)
    axes[-1].set_xlabel("ms from the start of the prefill step")
    return axes


__all__ = ["plot_kv_timelines"]


def layerwise_transfer(prefill_s: float, layer_bytes: float, num_layers: int, bandwidth: float) -> dict[str, Any]:
    """When each layer's K/V leaves and arrives if every layer is sent as soon as it is computed, one transfer
    at a time over a link of ``bandwidth`` bytes/s (layers take ``prefill_s / num_layers`` each): per layer
    ``(compute start, compute end, send start, send end)``, the prefill's end, the K/V's arrival, and the share
    of the transfer that ran during the prefill."""
    per_layer, send_s = prefill_s / num_layers, layer_bytes / bandwidth
    rows, link_free = [], 0.0
    for layer in range(num_layers):
        start, end = layer * per_layer, (layer + 1) * per_layer
        send_start = max(end, link_free)
        link_free = send_start + send_s
        rows.append((start, end, send_start, link_free))
    total_send = num_layers * send_s
    hidden = sum(max(0.0, min(prefill_s, e) - s) for _, _, s, e in rows)
    return {"layers": rows, "prefill_end": prefill_s, "kv_ready": link_free,
            "hidden_share": hidden / total_send if total_send else 1.0}


def plot_layerwise_transfer(prefill_s: float, layer_bytes: float, num_layers: int, bandwidth: float,
                            title: str = "", ax: Any = None) -> Any:
    """Two rows against time: the prefill's layers, and each layer's K/V on the link; what arrives after the
    prefill's end (the dashed line) is the wait a decode worker sees."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.4), layout="constrained")
    plan = layerwise_transfer(prefill_s, layer_bytes, num_layers, bandwidth)
    for i, (start, end, send_start, send_end) in enumerate(plan["layers"]):
        ax.barh(1, (end - start) * 1e3, left=start * 1e3, color="tab:orange" if i % 2 else "#f6c28b", edgecolor="w")
        ax.barh(0, (send_end - send_start) * 1e3, left=send_start * 1e3, color="tab:blue" if i % 2 else "#9cc3e6",
                edgecolor="w")
    ax.axvline(plan["prefill_end"] * 1e3, color="k", ls="--", lw=1)
    ax.set_yticks([0, 1], ["K/V on the link", "prefill, layer by layer"])
    ax.set_xlabel("ms from the start of the prefill")
    wait = max(0.0, plan["kv_ready"] - plan["prefill_end"]) * 1e3
    ax.set_title(f"{title}{' · ' if title else ''}{plan['hidden_share']:.0%} of the transfer hidden; "
                 f"K/V complete {wait:.1f} ms after the prefill")
    return ax


def draw_layerwise(model: str, prompt_len: int, link: str, bandwidth: float, ax: Any = None) -> Any:
    """:func:`plot_layerwise_transfer` for a real model's shape (a :func:`minipd.sim.costs.preset` name): its
    prefill of ``prompt_len`` tokens on an ideal H100 (roofline) and its bf16 K/V over ``link``."""
    from minipd.sim.costs import H100_SXM, kv_bytes_per_token, prefill_cost, preset

    config = preset(model)
    prefill_s = prefill_cost(config, prompt_len).time_on(H100_SXM)
    layer_bytes = kv_bytes_per_token(config, 2) * prompt_len / config.num_hidden_layers
    return plot_layerwise_transfer(prefill_s, layer_bytes, config.num_hidden_layers, bandwidth,
                                   title=f"{model}, {prompt_len} tokens, {link}", ax=ax)


def layerwise_explorer(links: Mapping[str, float], models: tuple[str, ...] = ("llama-3-8b", "llama-2-7b",
                                                                              "deepseek-v3")) -> Any:
    """A model menu, a prompt-length slider and a link menu over :func:`draw_layerwise`: how much of a layer-wise
    K/V transfer hides behind the prefill. Needs a live kernel; pair it with a static figure."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from minipd.viz.explorer import explorer_box

    model = widgets.Dropdown(options=list(models), description="model")
    prompt = widgets.SelectionSlider(options=[256, 512, 1024, 2048, 4096, 8192, 16384, 32768], value=4096,
                                     description="prompt tokens", continuous_update=False,
                                     style={"description_width": "initial"}, layout=widgets.Layout(width="420px"))
    link = widgets.Dropdown(options=list(links), description="link")
    out = widgets.Output()

    def redraw(_change: object = None) -> None:
        with out:
            out.clear_output(wait=True)
            draw_layerwise(model.value, prompt.value, link.value, links[link.value])
            plt.show()

    for control in (model, prompt, link):
        control.observe(redraw, names="value")
    redraw()

    return explorer_box([widgets.HBox([model, prompt, link]), out], "layer-wise transfer explorer",
                        "see the static figure above")
