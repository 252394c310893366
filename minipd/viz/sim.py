"""Chapter 05b's figures: the cluster simulator drawn as a diagram, checked against real runs, and what it says
about placements, links and the article's claims; and the cluster explorer widget.

Every ``plot_*`` function draws what it is given (numbers computed by :mod:`minipd.sim` in the notebook, or stored
JSON) and returns the Axes it drew on. :func:`simulate_placements` and :func:`draw_placements` (the explorer's
figure and its static fallback) simulate the placements they are asked to compare; :func:`busy_share` measures a
simulated run's GPUs while requests arrive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from minipd.viz.diagrams import DECODE_COLOR, GROUP_COLORS, PREFILL_COLOR, _arrow, _box, _note

if TYPE_CHECKING:
    from minipd.serve.loadgen import RequestResult, Slo
    from minipd.sim.roofline import Link

#: Colours of the placements' kinds in every figure of the chapter.
KIND_COLORS = {"colocated": "tab:blue", "disaggregated": "tab:orange"}
REAL, SIMULATED = "0.15", "tab:red"
VARIANT_COLORS = ("tab:purple", "tab:olive")


def _axes(ax: Any, figsize: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _styles_by_name(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Placement name → (colour, line style): names with ``P`` and ``D`` in the disaggregated colour, the
    others colocated; the placements of one kind told apart by line style, in the order given."""
    line_styles = ("-", "--", ":", "-.")
    counts = {"colocated": 0, "disaggregated": 0}
    styles = {}
    for name in names:
        kind = "disaggregated" if "P" in name and "D" in name else "colocated"
        styles[name] = (KIND_COLORS[kind], line_styles[counts[kind] % len(line_styles)])
        counts[kind] += 1
    return styles


# --- the simulator, as a diagram ------------------------------------------------------------------


def plot_simulator(ax: Any = None) -> Any:
    """What the cluster simulator is made of: arrivals → router → instances → (K/V link) → tokens.

    Two lanes share the arrivals and the router: a colocated cluster (instances that prefill and decode) and a
    disaggregated one (prefill instances, a K/V link, decode instances). Every instance is the engine's own
    ``StepCore`` with its ``Scheduler`` and ``BlockManager``; only the executor (a step-time model) and the
    clock (simpy's) are stand-ins. Boxes have gids ``"sim:<name>"``.
    """
    ax = _axes(ax, (13, 5.4))
    core = GROUP_COLORS["core"]
    h = 0.95

    def box(name: str, x: float, y: float, w: float, title: str, detail: str, face: str, hh: float = h) -> None:
        _box(ax, x - w / 2, y - hh / 2, w, hh, face, gid=f"sim:{name}")
        ax.text(x, y + hh / 2 - 0.22, title, ha="center", va="center", fontsize=9.5, weight="bold", zorder=3)
        ax.text(x, y - 0.1, detail, ha="center", va="center", fontsize=7.3, color="0.25", zorder=3)

    top, bottom = 4.1, 1.75
    box("arrivals", 0.95, 2.95, 1.6, "arrivals", "Poisson, gamma\nor a trace:\n(time, prompt, output)",
        GROUP_COLORS["front"], 1.4)
    box("router", 2.95, 2.95, 1.5, "router", "colocated: fewest\nrequests; prefill:\nfewest queued tokens",
        GROUP_COLORS["front"], 1.4)
    instance = "real Scheduler +\nBlockManager; executor:\nstep_time(StepWork)"
    box("prefill", 5.4, top, 2.1, "prefill instances", instance, PREFILL_COLOR, 1.25)
    box("link", 7.85, top, 1.9, "K/V link",
        "latency + bytes/bandwidth,\none transfer at a time\n(layer-wise: partly hidden)", "0.93", 1.25)
    box("decode", 10.3, top, 2.1, "decode instances", instance, DECODE_COLOR, 1.25)
    box("colocated", 7.85, bottom, 2.6, "colocated instances", "prefill chunks and decodes share steps:\n" + instance
        .replace("\n", " ", 1), core, 1.25)
    box("results", 12.35, 2.95, 1.1, "tokens", "TTFT, TPOT,\nattainment,\ngoodput,\nbusy share", "0.97", 1.6)

    _arrow(ax, (1.77, 2.95), (2.18, 2.95))
    _arrow(ax, (3.72, 3.2), (4.33, top - 0.1))
    _note(ax, 3.75, 3.95, "disaggregated", size=7)
    _arrow(ax, (3.72, 2.7), (6.53, bottom + 0.1))
    _note(ax, 4.6, 2.05, "colocated", size=7)
    _arrow(ax, (6.47, top), (6.88, top))
    _note(ax, 6.65, top + 0.85, "1st token here;\nK/V held until\ndecode has blocks", size=6.8)
    _arrow(ax, (8.82, top), (9.23, top))
    _note(ax, 9.05, top + 0.85, "decode: fewest\nrequests", size=6.8)
    _arrow(ax, (11.37, top - 0.1), (11.78, 3.4))
    _arrow(ax, (9.17, bottom + 0.1), (11.78, 2.5))
    # The clock and the step-time models, shared by every instance.
    _box(ax, 0.25, 0.0, 12.5, 0.72, "white", gid="sim:models", ls="--")
    ax.text(6.5, 0.36, "step_time(StepWork) → seconds, one of: FittedStepTime (least squares on a real run's steps) · "
            "RooflineStepTime (a GPU's datasheet, tensor parallel)\n· ReplayStepTime (a real run's steps, in order)."
            "   The clock: simpy, a discrete-event simulation (a step's tokens arrive when its time has passed)",
            ha="center", va="center", fontsize=7.5, color="0.25", zorder=3)
    ax.set_title("the cluster simulator: minipd's scheduler on a simulated clock", fontsize=10.5, loc="left")
    ax.set(xlim=(0, 13), ylim=(-0.1, 5.1))
    ax.axis("off")
    return ax


# --- the simulator against real runs --------------------------------------------------------------

#: The latency percentiles the validation figures draw, as :func:`minipd.sim.validate.compare` names them.
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"))


def plot_replay(real: Sequence[RequestResult], simulated: Sequence[RequestResult], axes: Any = None,
                title: str = "") -> Any:
    """Each request's TTFT and TPOT, real (x) against simulated (y), on two panels with the line y = x: a replay
    of a real run's step times should put every point on it."""
    import matplotlib.pyplot as plt

    if len(real) != len(simulated) or not real:
        raise ValueError(f"need the same requests on both sides, got {len(real)} real and {len(simulated)} simulated")
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    for ax, (field, label) in zip(axes, METRICS, strict=True):
        pairs = [(getattr(r, field) * 1e3, getattr(s, field) * 1e3) for r, s in zip(real, simulated, strict=True)
                 if r.ok and s.ok and getattr(r, field) > 0]
        xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
        ax.scatter(xs, ys, s=16, color=SIMULATED, alpha=0.7, label="one request", gid="requests")
        top = max(xs + ys) * 1.05
        ax.plot([0, top], [0, top], color="0.5", lw=1, ls="--", label="simulated = real", gid="diagonal")
        ax.set(xlim=(0, top), ylim=(0, top), xlabel=f"real {label} (ms)", ylabel=f"simulated {label} (ms)")
        ax.set_title(f"{title}{': ' if title else ''}{label}, {len(pairs)} requests", loc="left", fontsize=10)
        ax.legend(frameon=False, fontsize="small", loc="upper left")
    return axes


def plot_real_vs_sim(runs: Mapping[str, Sequence[Mapping[str, Any]]], goodput: Mapping[str, Mapping[str, float]]
                     | None = None, axes: Any = None, machine: str = "", variants: Mapping[str, str] | None = None
                     ) -> Any:
    """Real against simulated latency percentiles as the rate grows, one row of panels per engine.

    ``runs`` maps a label (``"colocated"``) to rows, each with ``"rate"`` and, for ``median_ttft_ms``,
    ``p90_ttft_ms``, ``median_tpot_ms`` and ``p90_tpot_ms``, a dict with ``"real"`` and ``"sim"`` (and, optionally,
    ``"repeat"``: the same workload run for real a second time, the machine's own spread); the rows of
    :func:`minipd.sim.validate.compare` with a rate added, or of ``assets/sim/cpu_validation.json``. With
    ``goodput`` (label → ``{"real": rate, "sim": rate}``, optionally ``"repeat"``: the real search run again) a
    third column compares the goodputs. ``variants`` (a row key → its legend label) draws the P50s of another
    simulation kept in the rows under that key (as ``scripts/validate_simulator.py`` keeps ``"shared_cores"``),
    dotted, where an engine's rows have it."""
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("nothing to draw: no runs")
    columns = 3 if goodput else 2
    if axes is None:
        _, axes = plt.subplots(len(runs), columns, figsize=(4.6 * columns, 3.2 * len(runs)), layout="constrained",
                               squeeze=False)
    for row_axes, (label, rows) in zip(axes, runs.items(), strict=True):
        rates = [r["rate"] for r in rows]
        for ax, (field, name) in zip(row_axes, METRICS, strict=False):
            for pct, ls, marker in (("median", "-", "o"), ("p90", "--", "s")):
                key = f"{pct}_{field}_ms"
                pretty = "P50" if pct == "median" else "P90"
                ax.plot(rates, [r[key]["real"] for r in rows], ls=ls, marker=marker, color=REAL,
                        label=f"real {pretty}", gid=f"real:{key}")
                ax.plot(rates, [r[key]["sim"] for r in rows], ls=ls, marker=marker, color=SIMULATED, mfc="none",
                        label=f"simulated {pretty}", gid=f"sim:{key}")
                for (variant, name_of), color in zip((variants or {}).items(), VARIANT_COLORS, strict=False):
                    if pct == "median" and all(variant in r for r in rows):
                        ax.plot(rates, [r[variant][key]["sim"] for r in rows], ls=":", marker="^", color=color,
                                mfc="none", label=f"{name_of} P50", gid=f"{variant}:{key}")
                if all("repeat" in r[key] for r in rows):
                    ax.scatter(rates, [r[key]["repeat"] for r in rows], marker="x", color="0.55", zorder=3,
                               label="real again" if pct == "median" else None, gid=f"repeat:{key}")
            ax.set(xlabel="offered rate (requests/s)", ylabel=f"{name} (ms)")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{label}: {name}", loc="left", fontsize=10)
        row_axes[0].legend(frameon=False, fontsize="x-small", ncol=2)
        if goodput:
            ax = row_axes[2]
            g = goodput[label]
            names, heights, colors = ["real", "simulated"], [g["real"], g["sim"]], [REAL, SIMULATED]
            if "repeat" in g:
                names.append("real again")
                heights.append(g["repeat"])
                colors.append("0.55")
            bars = ax.bar(names, heights, color=colors)
            for bar in bars:
                bar.set_gid("goodput")
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set(ylabel="goodput (requests/s)")
            ax.set_title(f"{label}: goodput ({g['sim'] / g['real'] - 1:+.0%} simulated)", loc="left", fontsize=10)
    if machine:
        axes[0][0].figure.suptitle(machine, fontsize=10.5)
    return axes


def plot_step_times(tokens: Sequence[int], measured_ms: Sequence[float], predicted_ms: Mapping[str, Sequence[float]],
                    ax: Any = None, title: str = "") -> Any:
    """Each step's time against the tokens it computed: measured (grey), and as each step-time model predicts
    it for the same work (``predicted_ms``: label → one value per step)."""
    ax = _axes(ax, (7.5, 3.8))
    if not tokens or len(tokens) != len(measured_ms):
        raise ValueError("need one measured time per step")
    ax.scatter(tokens, measured_ms, s=6, color="0.6", label="measured", gid="measured")
    for (label, values), color in zip(predicted_ms.items(), ("tab:red", "tab:blue", "tab:green"), strict=False):
        if len(values) != len(tokens):
            raise ValueError(f"{label}: {len(values)} predictions for {len(tokens)} steps")
        ax.scatter(tokens, values, s=6, color=color, label=label, gid=f"model:{label}")
    ax.set(xscale="log", xlabel="tokens in the step", ylabel="step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, loc="left", fontsize=10)
    ax.legend(frameon=False, fontsize="small", markerscale=3)
    return ax


# --- what the simulator says ----------------------------------------------------------------------


def plot_attainment(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], target: float = 0.9,
                    ax: Any = None, title: str = "", per_device: Mapping[str, int] | None = None) -> Any:
    """SLO attainment (share of requests meeting both SLOs) against the rate, one line per placement; the target
    (90%) dashed. ``curves`` maps a placement's name to (rates, attainments); names with ``P`` and ``D`` are drawn
    in the disaggregated colour. With ``per_device`` (name → devices), the x axis is the rate per device."""
    ax = _axes(ax, (7.5, 3.8))
    if not curves:
        raise ValueError("nothing to draw: no curves")
    styles = _styles_by_name(list(curves))
    for name, (rates, shares) in curves.items():
        scale = per_device[name] if per_device else 1
        color, line = styles[name]
        ax.plot([r / scale for r in rates], [100 * s for s in shares], marker="o", ms=4, ls=line, color=color,
                label=name, gid=f"curve:{name}")
    ax.axhline(100 * target, color="0.4", ls="--", lw=1, gid="target")
    ax.text(ax.get_xlim()[0], 100 * target, f" {target:.0%} target", va="bottom", fontsize=8, color="0.3")
    ax.set(xlabel="requests/s per GPU" if per_device else "offered rate (requests/s)",
           ylabel="requests meeting both SLOs (%)", ylim=(0, 103))
    ax.set_title(title, loc="left", fontsize=10)
    ax.legend(frameon=False, fontsize="small")
    return ax


def plot_goodput_bars(rows: Sequence[Mapping[str, Any]], ax: Any = None, title: str = "",
                      highlight: Sequence[str] = ()) -> Any:
    """Goodput per GPU of each placement (``rows``: ``name``, ``kind`` ``"colocated"`` or ``"disaggregated"``,
    ``per_device``), best first, as horizontal bars coloured by kind; names in ``highlight`` are hatched."""
    ax = _axes(ax, (7.5, 0.35 * len(rows) + 1.2))
    if not rows:
        raise ValueError("nothing to draw: no placements")
    ordered = sorted(rows, key=lambda r: r["per_device"])
    bars = ax.barh(range(len(ordered)), [r["per_device"] for r in ordered],
                   color=[KIND_COLORS[r["kind"]] for r in ordered],
                   hatch=None)
    for bar, r in zip(bars, ordered, strict=True):
        bar.set_gid(f"placement:{r['name']}")
        if r["name"] in highlight:
            bar.set_hatch("//")
    ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    ax.set_yticks(range(len(ordered)), [r.get("label", r["name"]) for r in ordered])
    ax.set_xlabel("goodput per GPU (requests/s at which 90% meet both SLOs)")
    ax.set_xlim(0, max(r["per_device"] for r in ordered) * 1.18)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()], frameon=False, fontsize="small",
              loc="lower right")
    ax.set_title(title, loc="left", fontsize=10)
    return ax


def plot_goodput_vs_duration(points: Sequence[Mapping[str, Any]], marks: Mapping[str, float] | None = None,
                             ax: Any = None, title: str = "") -> Any:
    """The goodput per GPU a search finds against the length of its runs (``points``: ``placement``,
    ``duration_s``, ``per_device``), one line per placement (names with ``P`` and ``D`` in the disaggregated
    colour); ``marks`` (label → seconds) are drawn as dotted vertical lines."""
    if not points:
        raise ValueError("nothing to draw: no points")
    ax = _axes(ax, (7.5, 3.8))
    styles = _styles_by_name(list(dict.fromkeys(p["placement"] for p in points)))
    for name, (color, line) in styles.items():
        mine = sorted((p for p in points if p["placement"] == name), key=lambda p: p["duration_s"])
        ax.plot([p["duration_s"] for p in mine], [p["per_device"] for p in mine], marker="o", ms=4, ls=line,
                color=color, label=name, gid=f"curve:{name}")
    for label, seconds in (marks or {}).items():
        ax.axvline(seconds, color="0.4", ls=":", lw=1, gid=f"mark:{label}")
        ax.text(seconds, 0.98, f" {label}", transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="0.3")
    ax.set(xscale="log", xlabel="seconds of arrivals in each run of the search",
           ylabel="goodput per GPU (req/s)", ylim=(0, None))
    from matplotlib.ticker import NullFormatter

    lengths = sorted({p["duration_s"] for p in points})
    ax.set_xticks(lengths, [f"{v:.0f}" for v in lengths])  # the lengths tried, not decades
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room for the marks' labels above the lines
    ax.legend(frameon=False, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def plot_best_placement(cells: Sequence[Mapping[str, Any]], axes: Any = None, title: str = "") -> Any:
    """For each TPOT SLO, a grid of prompt lengths × output lengths: the colour is the best disaggregated
    placement's goodput per GPU over the best colocated one's (above 1, orange: disaggregation wins), the text
    the best placement of all and that ratio. ``cells``: ``prompts``, ``outputs``, ``tpot_slo_ms`` and
    ``placements`` (rows as :func:`plot_goodput_bars` takes them)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    if not cells:
        raise ValueError("nothing to draw: no cells")
    slos = sorted({c["tpot_slo_ms"] for c in cells})
    prompts = list(dict.fromkeys(c["prompts"] for c in cells))
    outputs = list(dict.fromkeys(c["outputs"] for c in cells))
    if axes is None:
        _, axes = plt.subplots(1, len(slos), figsize=(5.2 * len(slos), 3.6), layout="constrained", squeeze=False)
        axes = axes[0]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.5, vmax=1.5)
    image = None
    for ax, slo in zip(axes, slos, strict=True):
        ratio = np.full((len(prompts), len(outputs)), np.nan)
        for cell in (c for c in cells if c["tpot_slo_ms"] == slo):
            i, j = prompts.index(cell["prompts"]), outputs.index(cell["outputs"])
            best = {k: max((r for r in cell["placements"] if r["kind"] == k), key=lambda r: r["per_device"],
                           default=None) for k in KIND_COLORS}
            if best["colocated"] is None or best["disaggregated"] is None:
                continue
            co, dis = best["colocated"]["per_device"], best["disaggregated"]["per_device"]
            ratio[i, j] = dis / co if co > 0 else np.inf
            winner = best["disaggregated"] if dis > co else best["colocated"]
            text = f"{winner['name']}\n{dis / co:.2f}×" if co > 0 else f"{winner['name']}\n(colocated: 0)"
            ax.text(j, i, text, ha="center", va="center", fontsize=8.5, gid=f"cell:{i},{j}")
        image = ax.imshow(np.clip(np.nan_to_num(ratio, nan=1.0, posinf=1.5), 0.5, 1.5), cmap="PuOr_r", norm=norm,
                          aspect="auto")
        ax.set_xticks(range(len(outputs)), outputs)
        ax.set_yticks(range(len(prompts)), prompts)
        ax.set(xlabel="output tokens", ylabel="prompt tokens")
        ax.set_title(f"TPOT SLO {slo:g} ms", loc="left", fontsize=10)
    if image is not None:
        axes[-1].figure.colorbar(image, ax=list(axes), label="best disaggregated / best colocated\n(goodput per GPU)")
    if title:
        axes[0].figure.suptitle(title, fontsize=10.5)
    return axes


def plot_transfer_share(shares: Mapping[str, tuple[Sequence[int], Sequence[float]]], ax: Any = None,
                        title: str = "") -> Any:
    """The K/V transfer's share of the time to the second token, against the prompt length, one line per
    (link, mode): ``shares`` maps a label (``"400G IB, whole"``, ``"400G IB, layer-wise"``) to (prompt lengths,
    shares in [0, 1]); labels ending in ``layer-wise`` are dashed."""
    ax = _axes(ax, (7.5, 3.8))
    if not shares:
        raise ValueError("nothing to draw")
    colors: dict[str, str] = {}
    palette = ("tab:green", "tab:purple", "tab:brown", "tab:cyan")
    for label, (lengths, values) in shares.items():
        link = label.rsplit(",", 1)[0]
        color = colors.setdefault(link, palette[len(colors) % len(palette)])
        ax.plot(lengths, [100 * v for v in values], marker="o", ms=4, color=color,
                ls="--" if label.endswith("layer-wise") else "-", label=label, gid=f"share:{label}")
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="transfer / (arrival → 2nd token) (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, loc="left", fontsize=10)
    ax.legend(frameon=False, fontsize="small")
    return ax


#: The article's before/after (a cloud provider's report): TTFT ms, TPOT ms/token, GPU utilisation.
ARTICLE = {"ttft_ms": (150.0, 105.0), "tpot_ms": (20.0, 15.0), "busy": (0.60, 0.84)}


def plot_claims(points: Sequence[Mapping[str, Any]], axes: Any = None, title: str = "",
                article: Mapping[str, tuple[float, float]] = ARTICLE) -> Any:
    """Colocated against disaggregated as the rate grows: P50 TTFT, mean TPOT and the busy share of the GPUs,
    with the article's before (colocated) and after (disaggregated) values as dotted lines. ``points``: ``rate``
    and, for ``"colocated"`` and ``"disaggregated"``, ``median_ttft_ms``, ``mean_tpot_ms`` and ``busy``
    (instance → busy share; averaged over the instances)."""
    import matplotlib.pyplot as plt

    if not points:
        raise ValueError("nothing to draw: no points")
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(14, 3.6), layout="constrained")
    rates = [p["rate"] for p in points]
    panels = (("median_ttft_ms", "P50 TTFT (ms)", "ttft_ms", 1.0), ("mean_tpot_ms", "mean TPOT (ms)", "tpot_ms", 1.0),
              ("busy", "busy share of the GPUs (%)", "busy", 100.0))
    for ax, (key, label, claim, scale) in zip(axes, panels, strict=True):
        for kind, which in (("colocated", 0), ("disaggregated", 1)):
            if key == "busy":
                values = [sum(p[kind]["busy"].values()) / len(p[kind]["busy"]) for p in points]
            else:
                values = [p[kind][key] for p in points]
            ax.plot(rates, [scale * v for v in values], marker="o", color=KIND_COLORS[kind],
                    label=f"{kind} ({points[0][kind].get('placement', '')})", gid=f"{kind}:{key}")
            ax.axhline(scale * article[claim][which], color=KIND_COLORS[kind], ls=":", lw=1.2,
                       gid=f"article:{kind}:{claim}")
        ax.set(xlabel="offered rate (requests/s)", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.set_title(label.split(" (")[0], loc="left", fontsize=10)
    axes[0].legend(frameon=False, fontsize="small")
    axes[2].text(0.98, 0.04, "dotted: the article's before (blue)\nand after (orange)", transform=axes[2].transAxes,
                 ha="right", va="bottom", fontsize=8, color="0.3")
    if title:
        axes[0].figure.suptitle(title, fontsize=10.5)
    return axes


# --- the explorer ---------------------------------------------------------------------------------


def simulate_placements(placements: Sequence[str], rate: float, prompt_len: int, output_len: int, link: Link,
                        model: str = "llama-3-8b", device: Any = None, duration_s: float = 8.0,
                        seed: int = 0) -> dict[str, Any]:
    """Each placement (``"4C"``, ``"2P+2D"``, as :func:`minipd.sim.cli.parse_placement` reads them) of ``model`` on
    ``device`` (default H100 SXM) simulated on the same workload: Poisson arrivals at ``rate`` for ``duration_s``
    (at least 100 requests), prompts uniform in ``[prompt_len / 2, prompt_len]`` and outputs in
    ``[output_len / 2, output_len]``. Returns placement → :class:`~minipd.sim.cluster.SimResult`."""
    from minipd.sim.cli import parse_placement
    from minipd.sim.cluster import simulate
    from minipd.sim.costs import H100_SXM, preset
    from minipd.sim.search import GpuCluster, WorkloadShape

    cluster = GpuCluster(preset(model), H100_SXM if device is None else device, link)
    shape = WorkloadShape(f"{max(1, prompt_len // 2)}:{prompt_len}", f"{max(1, output_len // 2)}:{output_len}",
                          num_requests=100, duration_s=duration_s, seed=seed)
    workload = shape.at(rate)
    return {name: simulate(parse_placement(name, cluster), workload, keep_timeline=True) for name in placements}


def plot_placements(results: Mapping[str, Any], slo: Slo, axes: Any = None, title: str = "") -> Any:
    """Simulated placements side by side (``results``: name → :class:`~minipd.sim.cluster.SimResult`, simulated with
    ``keep_timeline=True``): the share of requests within each TTFT and each TPOT (cumulative, the SLOs dashed),
    and each placement's SLO attainment and the busy share of its GPUs while requests arrived
    (:meth:`~minipd.sim.cluster.SimResult.utilisation`)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if not results:
        raise ValueError("nothing to draw: no results")
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(14, 3.5), layout="constrained", width_ratios=(1, 1, 0.8))
    names = list(results)
    kinds = {n: "disaggregated" if results[n].spec.disaggregated else "colocated" for n in names}
    # Placements of one kind share its colour and differ by line style.
    styles = {n: ("-", "--", ":", "-.")[[m for m in names if kinds[m] == kinds[n]].index(n) % 4] for n in names}
    for (field, label), ax, limit in zip(METRICS, axes, (slo.ttft_ms, slo.tpot_ms), strict=False):
        for name in names:
            values = np.sort([getattr(r, field) * 1e3 for r in results[name].requests
                              if not r.dropped and (field != "tpot" or r.output_len > 1)])
            ax.plot(values, 100 * np.arange(1, len(values) + 1) / max(len(values), 1), color=KIND_COLORS[kinds[name]],
                    ls=styles[name], label=name, gid=f"cdf:{field}:{name}")
        if limit is not None:
            ax.axvline(limit, color="0.3", ls="--", lw=1, gid=f"slo:{field}")
        ax.set(xscale="log", xlabel=f"{label} (ms)", ylabel="requests (%)", ylim=(0, 102))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{label}: share of requests within", loc="left", fontsize=10)
        ax.legend(frameon=False, fontsize="small", loc="lower right")
    ax = axes[2]
    width = 0.38
    met = [100 * results[n].attainment(slo) for n in names]
    busy = [100 * float(np.mean(list(results[n].utilisation(while_arriving=True).values()))) for n in names]
    x = np.arange(len(names))
    a = ax.bar(x - width / 2, met, width, color=[KIND_COLORS[kinds[n]] for n in names], label="met SLOs")
    b = ax.bar(x + width / 2, busy, width, color="0.75", label="GPUs busy")
    for bar in a:
        bar.set_gid("attainment")
    for bar in b:
        bar.set_gid("busy")
    ax.bar_label(a, fmt="%.0f%%", fontsize=8)
    ax.bar_label(b, fmt="%.0f%%", fontsize=8)
    ax.axhline(90, color="0.4", ls=":", lw=1)
    ax.set_xticks(x, names)
    ax.set(ylim=(0, 115), ylabel="%")
    ax.set_title("met both SLOs · GPUs busy (while requests arrive)", loc="left", fontsize=10)
    ax.legend(frameon=False, fontsize="small", loc="upper right", ncol=2)
    if title:
        axes[0].figure.suptitle(title, fontsize=10.5)
    return axes


def draw_placements(rate: float, prompt_len: int, output_len: int, ttft_slo_ms: float, tpot_slo_ms: float,
                    link: Link, placement: str, devices: int = 4, axes: Any = None,
                    results: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """``devices`` colocated H100s against ``placement`` for Llama-3-8B (:func:`simulate_placements`, then
    :func:`plot_placements`); the figure of :func:`cluster_explorer` and its static fallback. Pass ``results`` to
    redraw without simulating again. Returns the axes and the results."""
    from minipd.serve.loadgen import Slo

    if results is None:
        results = simulate_placements([f"{devices}C", placement], rate, prompt_len, output_len, link)
    title = (f"simulated: Llama-3-8B on {devices} H100s ({link.name} between prefill and decode), {rate:g} req/s, "
             f"prompts {prompt_len // 2}–{prompt_len}, outputs {output_len // 2}–{output_len} tokens, "
             f"SLOs {ttft_slo_ms:g} / {tpot_slo_ms:g} ms")
    return plot_placements(results, Slo(ttft_slo_ms, tpot_slo_ms), axes, title), dict(results)


def cluster_explorer(links: Mapping[str, Link] | None = None, devices: int = 4,
                     start: Mapping[str, Any] | None = None) -> Any:
    """Sliders for the rate, the two SLOs and the prompt and output lengths, menus for the K/V link and the
    disaggregated placement, over :func:`draw_placements` (Llama-3-8B on ``devices`` H100s, colocated against the
    placement). ``start`` sets the first values (the keywords of :func:`draw_placements`: ``rate``, ``prompt_len``,
    ``output_len``, ``ttft_slo_ms``, ``tpot_slo_ms``, ``link`` (a :class:`~minipd.sim.roofline.Link`),
    ``placement``). Moving an SLO redraws without simulating again. Needs a live kernel; pair it with a static
    figure of its starting point."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from minipd.viz.explorer import explorer_box

    if links is None:
        from minipd.sim.roofline import IB_400G, NVLINK4, PCIE5_X16

        links = {link.name: link for link in (IB_400G, PCIE5_X16, NVLINK4)}
    shapes = [f"{p}P+{devices - p}D" for p in range(1, devices)]
    first = {"rate": 8.0, "prompt_len": 1024, "output_len": 128, "ttft_slo_ms": 450, "tpot_slo_ms": 40,
             "link": next(iter(links.values())), "placement": shapes[len(shapes) // 2], **(start or {})}
    link_names = {link.name: name for name, link in links.items()}
    if first["link"].name not in link_names or first["placement"] not in shapes:
        raise ValueError(f"start: the link must be one of {sorted(links)} and the placement one of {shapes}")
    wide = {"style": {"description_width": "initial"}, "layout": widgets.Layout(width="330px"),
            "continuous_update": False}
    rate = widgets.FloatSlider(value=first["rate"], min=1.0, max=160.0, step=1.0, description="requests/s", **wide)
    ttft = widgets.IntSlider(value=first["ttft_slo_ms"], min=50, max=2000, step=50, description="TTFT SLO (ms)",
                             **wide)
    tpot = widgets.IntSlider(value=first["tpot_slo_ms"], min=5, max=100, step=5, description="TPOT SLO (ms)", **wide)
    prompt = widgets.SelectionSlider(options=[128, 256, 512, 1024, 2048, 4096, 8192], value=first["prompt_len"],
                                     description="prompt tokens", **wide)
    output = widgets.SelectionSlider(options=[16, 32, 64, 128, 256, 512, 1024], value=first["output_len"],
                                     description="output tokens", **wide)
    link = widgets.Dropdown(options=list(links), value=link_names[first["link"].name], description="K/V link",
                            style=wide["style"])
    placement = widgets.Dropdown(options=shapes, value=first["placement"], description="placement",
                                 style=wide["style"])
    out = widgets.Output()
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def redraw(_change: object = None) -> None:
        key = (rate.value, prompt.value, output.value, link.value, placement.value)
        with out:
            out.clear_output(wait=True)
            _, cache[key] = draw_placements(rate.value, prompt.value, output.value, ttft.value, tpot.value,
                                            links[link.value], placement.value, devices, results=cache.get(key))
            plt.show()

    for control in (rate, ttft, tpot, prompt, output, link, placement):
        control.observe(redraw, names="value")
    redraw()
    rows = [widgets.HBox([rate, prompt, output]), widgets.HBox([ttft, tpot, link, placement]), out]
    return explorer_box(rows, "cluster explorer", "see the static figure above")


__all__ = ["ARTICLE", "KIND_COLORS", "cluster_explorer", "draw_placements", "plot_attainment",
           "plot_best_placement", "plot_claims", "plot_goodput_bars", "plot_goodput_vs_duration", "plot_placements",
           "plot_real_vs_sim", "plot_replay", "plot_simulator", "plot_step_times", "plot_transfer_share",
           "simulate_placements"]
