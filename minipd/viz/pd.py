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
