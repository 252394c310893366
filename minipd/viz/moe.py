"""Chapter 07's figures: mixture-of-experts sizes, routing, load, balancing, kernels and decode traffic.

Three kinds of helpers live here, each tested in ``tests/test_viz_moe.py``:

- **numbers** the plots need: :func:`moe_model` (parameters and FLOPs of real MoE models, from
  :mod:`minipd.sim.costs` presets, or from their public configs where no preset exists yet),
  :func:`expected_experts_touched` (and :func:`simulated_experts_touched`, the same by sampling),
  :func:`token_class`, :func:`capacity_load`;
- **plots**, each drawing on given Axes (or new ones) and returning them;
- a **widget**, :func:`routing_explorer` (top-k and capacity sliders over recorded router logits), with
  :func:`plot_capacity_sweep` as its static fallback.

matplotlib and ipywidgets are imported only when something is drawn.
"""

from __future__ import annotations

import functools
import keyword
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from minipd.config import ModelConfig

__all__ = [
    "MOE_MODELS",
    "TOKEN_CLASSES",
    "CapacityLoad",
    "MoEModel",
    "QuantizedRouting",
    "capacity_load",
    "expected_experts_touched",
    "moe_model",
    "plot_capacity_load",
    "plot_capacity_sweep",
    "plot_capacity_tradeoff",
    "plot_class_shares",
    "plot_expert_load",
    "plot_experts_touched",
    "plot_kernel_ladder",
    "plot_moe_map",
    "plot_placement",
    "plot_quantized_routing",
    "plot_router_heatmap",
    "plot_sparsity",
    "routing_explorer",
    "simulated_experts_touched",
    "token_class",
]

#: A rule for the distinct experts one MoE layer reads: ``touched(num_experts, top_k, batch)``.
TouchedRule = Callable[[int, int, int], float]


def _axes(ax: Any, ncols: int, figsize: tuple[float, float]) -> Any:
    """``ax`` as given, or a new row of ``ncols`` Axes (a single Axes when ``ncols`` is 1)."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, axes = plt.subplots(1, ncols, figsize=figsize, layout="constrained")
    return axes


# --- the chapter's map ----------------------------------------------------------------------------


def plot_moe_map(ax: Axes | None = None) -> Axes:
    """Where the chapter sits in the engine: a decoder layer's MLP replaced by router → dispatch → experts → combine."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    ax = _axes(ax, 1, (11, 3.3))

    def box(x: float, y: float, w: float, h: float, text: str, color: str, size: float = 9) -> None:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="0.3", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)

    def arrow(x0: float, y0: float, x1: float, y1: float) -> None:
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=10, color="0.3", lw=1))

    grey, hot = "0.92", "#fde2b8"
    box(0.0, 1.6, 1.3, 0.8, "requests\n→ scheduler", grey)
    box(1.6, 1.6, 1.4, 0.8, "model runner\n(chapters 01-06)", grey)
    box(3.3, 1.6, 1.2, 0.8, "attention\n+ KV cache", grey)
    box(9.9, 1.6, 1.1, 0.8, "sampler", grey)
    arrow(1.3, 2.0, 1.6, 2.0)
    arrow(3.0, 2.0, 3.3, 2.0)
    # The MoE block, this chapter: its four stages, and the experts fanned out.
    ax.add_patch(FancyBboxPatch((4.8, 0.15), 4.8, 3.1, boxstyle="round,pad=0.03", fc="#fff6e8", ec="tab:orange",
                                lw=1.5))
    ax.text(7.2, 3.05, "MoE layer (this chapter): replaces the dense MLP", ha="center", fontsize=9.5,
            color="tab:orange", weight="bold")
    arrow(4.5, 2.0, 4.9, 2.0)
    box(4.9, 1.6, 0.9, 0.8, "router\ntop-k", hot)
    box(6.0, 1.6, 0.95, 0.8, "dispatch\n(sort)", hot)
    for i in range(4):
        y = 0.35 + i * 0.62
        box(7.25, y, 0.9, 0.45, f"expert {i if i < 3 else 'E-1'}", "white", 8)
        arrow(6.95, 2.0, 7.25, y + 0.22)
        arrow(8.15, y + 0.22, 8.45, 2.0)
    box(8.45, 1.6, 1.0, 0.8, "combine\n(weighted)", hot)
    arrow(5.8, 2.0, 6.0, 2.0)
    arrow(9.45, 2.0, 9.9, 2.0)
    ax.text(7.7, 0.02, "expert parallel: dispatch and combine become all-to-alls", ha="center", fontsize=8,
            style="italic", color="0.35")
    ax.set(xlim=(-0.1, 11.1), ylim=(-0.1, 3.4))
    ax.axis("off")
    return ax


# --- real models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEModel:
    """A mixture-of-experts model's size, counted from its config (matmul weights in parameters)."""

    name: str
    total_params: int
    active_params: int
    #: Weights one token is multiplied by: attention, router, its top-k (and shared) experts, LM head.
    weights_per_token: int
    num_experts: int
    top_k: int
    moe_layers: int
    #: Parameters of one routed expert (gate, up and down).
    expert_params: int
    #: Parameters a decode step reads whatever the routing: everything but the routed experts and the
    #: (untied) embedding table, whose rows are looked up one per token.
    always_read_params: int
    #: Where the figures come from.
    source: str

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs per token (2 per weight; attention over the context left out)."""
        return 2 * self.weights_per_token

    @property
    def dense_flops_per_token(self) -> int:
        """What a token would cost if every expert ran: a dense model of the same parameters."""
        return 2 * (self.weights_per_token + self.moe_layers * (self.num_experts - self.top_k) * self.expert_params)

    def decode_weight_bytes(self, batch: int, dtype_bytes: int = 2, touched: TouchedRule | None = None) -> float:
        """Expected weight bytes one decode step of ``batch`` tokens reads.

        ``touched(num_experts, top_k, batch)`` gives the experts each MoE layer reads (by default
        :func:`expected_experts_touched`, uniform independent routing; chapter 07 passes the reader's formula or a
        simulation).
        """
        experts = (touched or expected_experts_touched)(self.num_experts, self.top_k, batch)
        return dtype_bytes * (self.always_read_params + self.moe_layers * experts * self.expert_params)


#: The three models of the chapter, by :mod:`minipd.sim.costs` preset name.
MOE_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")

#: huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (shape fields), for when minipd.sim.costs has no preset.
QWEN3_30B_A3B_CONFIG: dict[str, Any] = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    attention_bias=False, bos_token_id=151643, eos_token_id=151645)

#: huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (the fields counted here). The multi-token
#: prediction module (``num_nextn_predict_layers``) is left out, as in the 671B the model card quotes.
DEEPSEEK_V3_CONFIG: dict[str, int] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128)


def _from_model_config(name: str, cfg: ModelConfig, source: str) -> MoEModel:
    from minipd.sim.costs import count_parameters, matmul_weights_per_token

    counts = count_parameters(cfg)
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
    lm_head = cfg.vocab_size * cfg.hidden_size
    untied_embedding = counts.embedding if counts.lm_head else 0
    return MoEModel(name, counts.total, counts.active, matmul_weights_per_token(cfg) + lm_head, cfg.num_experts,
                    cfg.num_experts_per_tok, moe_layers, expert,
                    counts.total - moe_layers * cfg.num_experts * expert - untied_embedding, source)


def _deepseek_v3(c: Mapping[str, int] = DEEPSEEK_V3_CONFIG) -> MoEModel:
    """DeepSeek-V3 counted from its config: MLA attention, 3 dense layers, then 256 routed + 1 shared expert."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    # MLA: q down (+ norm) and up; a joint KV latent with the shared rotary key (+ norm); K/V up; output.
    attention = (h * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk_head
                 + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
                 + heads * c["v_head_dim"] * h)
    layers, dense_layers = c["num_hidden_layers"], c["first_k_dense_replace"]
    moe_layers = layers - dense_layers
    expert = 3 * h * c["moe_intermediate_size"]
    router = c["n_routed_experts"] * h + c["n_routed_experts"]  # gate and its selection-only bias
    shared = c["n_shared_experts"] * expert
    dense_mlp = 3 * h * c["intermediate_size"]
    norms = 2 * layers * h + h
    embedding = c["vocab_size"] * h  # and as many again for the untied LM head
    total = (2 * embedding + layers * attention + dense_layers * dense_mlp
             + moe_layers * (c["n_routed_experts"] * expert + shared + router) + norms)
    active_mlp = dense_layers * dense_mlp + moe_layers * (c["num_experts_per_tok"] * expert + shared + router)
    active = 2 * embedding + layers * attention + active_mlp + norms
    per_token = layers * attention + active_mlp + embedding  # norms are not matmuls; the LM head is
    routed = moe_layers * c["n_routed_experts"] * expert
    return MoEModel("deepseek-v3", total, active, per_token, c["n_routed_experts"], c["num_experts_per_tok"],
                    moe_layers, expert, total - routed - embedding,
                    "public config.json (deepseek-ai/DeepSeek-V3), counted in minipd.viz.moe")


def moe_model(name: str) -> MoEModel:
    """Sizes of the real MoE model ``name`` (one of :data:`MOE_MODELS`, or any MoE preset of :mod:`minipd.sim.costs`).

    A :mod:`minipd.sim.costs` preset is used when there is one (``source`` says so); otherwise the model's
    public config is counted here, with the same conventions. A dense model is a ``ValueError``.
    """
    from minipd.config import ModelConfig
    from minipd.sim.costs import MODEL_PRESETS

    preset = MODEL_PRESETS.get(name)
    if preset is not None and preset.is_moe:
        return _from_model_config(name, preset, "minipd.sim.costs preset")
    if name == "qwen3-30b-a3b":
        return _from_model_config(name, ModelConfig.from_dict(QWEN3_30B_A3B_CONFIG),
                                  "public config.json (Qwen/Qwen3-30B-A3B), counted with minipd.sim.costs")
    if name == "deepseek-v3":
        return _deepseek_v3()
    raise ValueError(f"unknown MoE model {name!r}; known: {', '.join(MOE_MODELS)}")


def plot_sparsity(models: Sequence[MoEModel], axes: Any = None) -> Any:
    """Parameters stored against parameters used per token, and FLOPs per token sparse against dense."""
    axes = _axes(axes, 2, (12, 3.6))
    names = [m.name for m in models]
    xs = range(len(models))
    for ax, (stored, used), unit, title in (
            (axes[0], ([m.total_params / 1e9 for m in models], [m.active_params / 1e9 for m in models]),
             "parameters (billions)", "parameters: stored vs used by one token"),
            (axes[1], ([m.dense_flops_per_token / 1e9 for m in models], [m.flops_per_token / 1e9 for m in models]),
             "GFLOP per token", "matmul FLOPs per token: all experts vs top-k")):
        ax.bar([x - 0.2 for x in xs], stored, width=0.4, color="0.7", label="total (every expert)")
        bars = ax.bar([x + 0.2 for x in xs], used, width=0.4, color="tab:orange", label="active (top-k experts)")
        for bar, s, u in zip(bars, stored, used, strict=True):
            ax.annotate(f"{u / s:.0%}", (bar.get_x() + bar.get_width() / 2, u), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), names)
        ax.set(yscale="log", ylabel=unit, title=title)
        ax.legend(fontsize="small", frameon=False)
    return axes


# --- routing on real tokens -----------------------------------------------------------------------

#: What :func:`token_class` calls a token.
TOKEN_CLASSES = ("keyword", "name", "number", "punctuation", "whitespace")


def token_class(text: str) -> str:
    """A Python token's kind, from its text as the tokenizer cut it: ``"keyword"`` (``def``, ``    return ``),
    ``"name"`` (an identifier), ``"number"``, ``"whitespace"`` (newlines, indentation) or ``"punctuation"``
    (operators, brackets, quotes, and pieces mixing them with letters such as ``(x``)."""
    word = text.strip()
    if not word:
        return "whitespace"
    if keyword.iskeyword(word) or keyword.issoftkeyword(word) or word in ("True", "False", "None", "self"):
        return "keyword"
    if word.isidentifier():
        return "name"
    if word.replace(".", "", 1).replace("_", "").isdigit():
        return "number"
    return "punctuation"


def plot_router_heatmap(probs: torch.Tensor, labels: Sequence[str], top_k: int = 2, ax: Axes | None = None,
                        title: str = "") -> Axes:
    """Router probabilities (tokens × experts) as a heatmap, each token's top-k experts ringed."""
    ax = _axes(ax, 1, (6, 0.22 * len(labels) + 1))
    p = probs.detach().float().cpu()
    im = ax.imshow(p, aspect="auto", cmap="Blues", vmin=0, vmax=1)
    chosen = p.topk(top_k, dim=-1).indices
    for t in range(p.shape[0]):
        ax.scatter(chosen[t].tolist(), [t] * top_k, s=30, facecolors="none", edgecolors="tab:orange", lw=1.2)
    ax.set_yticks(range(len(labels)), [repr(s)[1:-1] for s in labels], fontsize=7, family="monospace")
    ax.set_xticks(range(p.shape[1]))
    ax.set(xlabel="expert", title=title)
    ax.figure.colorbar(im, ax=ax, fraction=0.05, label="router probability")
    return ax


def plot_class_shares(shares: torch.Tensor, classes: Sequence[str], counts: Sequence[int] | None = None,
                      axes: Any = None) -> Any:
    """For each layer, how a token class's routing assignments spread over the experts (rows sum to 1)."""
    layers = shares.shape[0]
    axes = _axes(axes, layers, (3.1 * layers + 1, 2.6))
    rows = [f"{c} ({n})" for c, n in zip(classes, counts, strict=True)] if counts is not None else list(classes)
    for layer, ax in enumerate(axes):
        im = ax.imshow(shares[layer], aspect="auto", cmap="magma", vmin=0, vmax=float(shares.max()))
        ax.set_xticks(range(shares.shape[2]))
        ax.set_yticks(range(len(classes)), rows if layer == 0 else [""] * len(classes), fontsize=8)
        ax.set(xlabel="expert", title=f"layer {layer}")
    axes[-1].figure.colorbar(im, ax=list(axes), fraction=0.02, label="share of the class's assignments")
    return axes


# --- load and balance -----------------------------------------------------------------------------


def plot_expert_load(counts: torch.Tensor, axes: Any = None, title: str = "tokens per expert") -> Any:
    """One bar chart per layer of assignments per expert, the even share dotted, max/mean in the title."""
    c = counts.detach().float().cpu()
    layers = c.shape[0]
    axes = _axes(axes, layers, (3.0 * layers, 2.6))
    for layer, ax in enumerate(axes):
        mean = c[layer].mean().item()
        ax.bar(range(c.shape[1]), c[layer], color="tab:blue")
        ax.axhline(mean, color="k", ls=":", lw=1)
        ax.set_xticks(range(c.shape[1]))
        ax.set(xlabel="expert", title=f"layer {layer}: max/mean {c[layer].max().item() / mean:.2f}")
    axes[0].set_ylabel(title)
    return axes


def plot_capacity_tradeoff(points: Sequence[tuple[str, float, float, float]], axes: Any = None) -> Any:
    """Capacity settings as points: (name, hottest expert / mean load, KL to unconstrained, relative perplexity
    change); drop in red, reroute in green, unconstrained routing in black."""
    axes = _axes(axes, 2, (12, 3.6))
    for name, imbalance, kl, ppl_change in points:
        color = "k" if name == "auto" else ("tab:red" if "drop" in name else "tab:green")
        for ax, y in zip(axes, (kl, 100 * ppl_change), strict=True):
            ax.scatter(imbalance, y, color=color)
            ax.annotate(name, (imbalance, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    from matplotlib.lines import Line2D

    xlabel = "hottest expert / mean load (mean over layers)"
    key = [Line2D([], [], marker="o", ls="", color=c, label=n)
           for c, n in (("k", "no cap"), ("tab:red", "drop"), ("tab:green", "reroute"))]
    axes[0].legend(handles=key, fontsize="small", frameon=False)
    axes[0].set(xlabel=xlabel, ylabel="KL to unconstrained (nats/token)", title="evenness against drift")
    axes[1].set(xlabel=xlabel, ylabel="perplexity change (%)", title="red: drop, green: reroute, black: no cap")
    return axes


def plot_placement(loads: Sequence[float], num_devices: int = 4, redundant: int = 4, axes: Any = None) -> Any:
    """Tokens per device for three placements of one layer's experts: in order, packed by load, packed with replicas.

    Each bar is a device, stacked by the experts (or expert copies) it holds, labelled by expert id.
    """
    from minipd.moe.placement import contiguous_placement, imbalance, place_experts

    placements = {"experts in order": contiguous_placement(len(loads), num_devices),
                  "packed by measured load": place_experts(loads, num_devices),
                  f"+ {redundant} replicas of hot experts": place_experts(loads, num_devices, redundant)}
    axes = _axes(axes, 3, (13, 3.2))
    top = 0.0
    for ax, (name, placement) in zip(axes, placements.items(), strict=True):
        copies = placement.replicas
        for d, experts in enumerate(placement.slots):
            bottom = 0.0
            for e in experts:
                share = loads[e] / copies[e]
                ax.bar(d, share, bottom=bottom, color=f"C{e % 10}", edgecolor="white")
                ax.text(d, bottom + share / 2, str(e), ha="center", va="center", fontsize=7, color="white")
                bottom += share
            top = max(top, bottom)
        ax.axhline(sum(loads) / num_devices, color="k", ls=":", lw=1)
        ax.set_xticks(range(num_devices), [f"device {d}" for d in range(num_devices)])
        ax.set_title(f"{name}: max/mean {imbalance(placement, loads):.2f}", fontsize=10)
    for ax in axes:
        ax.set_ylim(0, top * 1.05)
    axes[0].set_ylabel("tokens (stacked by expert)")
    return axes


# --- kernels --------------------------------------------------------------------------------------


def plot_kernel_ladder(times: Mapping[str, Mapping[int, Mapping[str, Sequence[float]]]], axes: Any = None) -> Any:
    """Tokens per second of each MoE path: ``times[layer][tokens][path]`` are seconds per forward (min is drawn,
    the median as a tick)."""
    axes = _axes(axes, len(times), (6 * len(times), 3.2))
    if not hasattr(axes, "__len__"):  # one layer: plt.subplots gave a single Axes
        axes = [axes]
    for ax, (layer, by_tokens) in zip(axes, times.items(), strict=True):
        paths = list(next(iter(by_tokens.values())))
        width = 0.8 / len(paths)
        for i, path in enumerate(paths):
            xs = [j + (i - (len(paths) - 1) / 2) * width for j in range(len(by_tokens))]
            best = [tokens / min(by_tokens[tokens][path]) for tokens in by_tokens]
            median = [tokens / statistics.median(by_tokens[tokens][path]) for tokens in by_tokens]
            ax.bar(xs, best, width=width, label=path, color=f"C{i}")
            ax.scatter(xs, median, marker="_", color="k", s=80, zorder=3)
        ax.set_xticks(range(len(by_tokens)), [f"{t} tokens" for t in by_tokens])
        # A linear axis from 0: bar heights are then proportional to throughput, so a 1.16x gain looks like one.
        ax.set(ylabel="tokens/s (bar: best, tick: median)", title=layer)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small", frameon=False)
    return axes


# --- quantized routing ----------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedRouting:
    """One quantized routing or dispatch setting against full precision."""

    name: str
    #: Share of (token, layer) top-k sets left unchanged, on the full-precision model's hidden states.
    agreement: float
    #: Mean KL of next-token distributions to full precision (nats per token), and relative perplexity change.
    kl: float
    perplexity_change: float
    #: Share of greedy tokens equal to full precision's.
    greedy_equal: float
    #: Bytes one token's dispatch sends in one MoE layer.
    dispatch_bytes: int


def plot_quantized_routing(rows: Sequence[QuantizedRouting], axes: Any = None) -> Any:
    """Three panels: routing agreement, output drift (KL), and dispatch bytes per token, one bar per setting."""
    axes = _axes(axes, 3, (14, 3.2))
    names = [r.name for r in rows]
    panels = ((axes[0], [100 * r.agreement for r in rows], "top-k sets unchanged (%)", "tab:blue"),
              (axes[1], [r.kl for r in rows], "KL to full precision (nats/token)", "tab:red"),
              (axes[2], [r.dispatch_bytes for r in rows], "dispatch bytes / token / layer", "tab:green"))
    for ax, values, label, color in panels:
        ax.barh(names, values, color=color)
        ax.set_xlabel(label)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticks(range(len(names)), [""] * len(names))
    low = min(90.0, min(100 * r.agreement for r in rows) - 1)
    axes[0].set_xlim(low, 100.2)
    axes[0].set_xlabel(f"top-k sets unchanged (%; the axis starts at {low:.0f}%)")
    return axes


# --- decode traffic -------------------------------------------------------------------------------


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a layer reads for ``batch`` tokens, each picking ``top_k`` of ``num_experts``
    uniformly and independently: ``E * (1 - (1 - k/E) ** B)``."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


@functools.lru_cache(maxsize=4096)
def simulated_experts_touched(num_experts: int, top_k: int, batch: int, steps: int = 200, seed: int = 0) -> float:
    """Distinct experts a layer reads for ``batch`` tokens, averaged over ``steps`` simulated decode steps in which
    each token picks ``top_k`` distinct experts uniformly at random, independently of the others.

    No formula: every step is drawn (random scores, each token's ``top_k`` largest) and its distinct experts
    counted, so it agrees with :func:`expected_experts_touched` up to sampling noise. Large batches draw fewer
    steps (at most about 8M random numbers a point): there nearly every expert is read every step, and the
    count hardly varies. Seeded, so a figure drawn from it is the same on every run; cached, since a figure
    asks for the same point twice.
    """
    steps = max(1, min(steps, 2**23 // max(1, batch * num_experts)))
    gen = torch.Generator().manual_seed(seed)
    chunk = max(1, 2**21 // max(1, batch * num_experts))  # steps drawn at once: about 2M random numbers
    total, done = 0.0, 0
    while done < steps and batch > 0:
        n = min(chunk, steps - done)
        ids = torch.rand(n, batch, num_experts, generator=gen).topk(top_k, dim=-1).indices.reshape(n, -1)
        total += torch.zeros(n, num_experts).scatter_(1, ids, 1.0).sum().item()
        done += n
    return total / steps


def plot_experts_touched(models: Sequence[MoEModel], batches: Sequence[int],
                         measured: Mapping[int, Sequence[float]] | None = None, measured_experts: int = 8,
                         measured_top_k: int = 2, axes: Any = None, touched: TouchedRule | None = None,
                         touched_label: str = "uniform routing") -> Any:
    """Left: the expected share of experts one decode step reads against the batch, for each model with uniform
    routing, and ``measured[batch]`` (distinct experts per layer and step) of a small model as points.
    Right: the expected weight bytes a step reads (bf16), all the weights dotted.

    ``touched(num_experts, top_k, batch)`` draws the curves (by default :func:`expected_experts_touched`; chapter
    07 passes the reader's formula, or :func:`simulated_experts_touched` until it passes); ``touched_label`` says
    which in the titles."""
    touched = touched or expected_experts_touched
    axes = _axes(axes, 2, (12, 3.6))
    for i, m in enumerate(models):
        share = [touched(m.num_experts, m.top_k, b) / m.num_experts for b in batches]
        axes[0].plot(batches, share, color=f"C{i}", label=f"{m.name} ({m.num_experts} experts, top-{m.top_k})")
        gb = [m.decode_weight_bytes(b, touched=touched) / 1e9 for b in batches]
        axes[1].plot(batches, gb, color=f"C{i}", label=m.name)
        axes[1].axhline(2 * m.total_params / 1e9, color=f"C{i}", ls=":", lw=1)
    if measured:
        xs = sorted(measured)
        share = [sum(measured[b]) / len(measured[b]) / measured_experts for b in xs]
        axes[0].scatter(xs, share, color="k", zorder=3,
                        label=f"tiny-py-moe decode steps, measured ({measured_experts} experts, top-{measured_top_k})")
    axes[0].set(xscale="log", xlabel="decode batch (tokens per step)", ylabel="share of experts read per layer",
                ylim=(0, 1.05), title=f"experts one decode step touches\n(lines: {touched_label})")
    axes[0].yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    axes[0].legend(fontsize="small", frameon=False)
    axes[1].set(xscale="log", yscale="log", xlabel="decode batch (tokens per step)",
                ylabel="weight GB read per step (bf16)",
                title=f"weights read per step (dotted: all of them)\n(lines: {touched_label})")
    axes[1].legend(fontsize="small", frameon=False)
    return axes


# --- capacity on recorded routing, and the widget -------------------------------------------------


@dataclass(frozen=True)
class CapacityLoad:
    """One layer's routing with a capacity: assignments per expert before and after, and what moved."""

    unconstrained: torch.Tensor
    kept: torch.Tensor
    capacity: int
    dropped: float
    rerouted: float


def capacity_load(logits: torch.Tensor, top_k: int, capacity_factor: float | None,
                  policy: str = "drop") -> CapacityLoad:
    """Route ``logits`` (T, E) top-k as Mixtral does, cap each expert at ``capacity_factor`` times an even
    share (None: no cap) with :func:`minipd.moe.capacity.enforce_capacity`, and count the load.

    ``dropped``/``rerouted`` are shares of the ``T * top_k`` assignments.
    """
    from minipd.moe.capacity import capacity, enforce_capacity
    from minipd.moe.router import softmax_topk

    tokens, experts = logits.shape
    weights, ids = softmax_topk(logits, top_k)
    before = torch.bincount(ids.reshape(-1), minlength=experts)
    if capacity_factor is None:
        return CapacityLoad(before, before, tokens * top_k, 0.0, 0.0)
    probs = torch.softmax(logits.float(), dim=-1)
    _, capped = enforce_capacity(probs, weights, ids, capacity_factor, policy)
    kept = capped[capped >= 0]
    total = max(1, ids.numel())
    limit = capacity(tokens, top_k, experts, capacity_factor)
    return CapacityLoad(before, torch.bincount(kept, minlength=experts), limit, float((capped < 0).sum()) / total,
                        float(((capped != ids) & (capped >= 0)).sum()) / total)


def plot_capacity_load(logits: torch.Tensor, top_k: int, capacity_factor: float | None, policy: str = "drop",
                       ax: Axes | None = None) -> Axes:
    """Load per expert without a cap (outline) and with it (bars), the capacity dashed, shares moved in the title."""
    ax = _axes(ax, 1, (6.5, 3.0))
    load = capacity_load(logits, top_k, capacity_factor, policy)
    experts = range(load.kept.numel())
    ax.bar(experts, load.unconstrained, color="none", edgecolor="0.4", label="no cap")
    ax.bar(experts, load.kept, color="tab:blue", alpha=0.8, label=f"cap {capacity_factor} ({policy})")
    if capacity_factor is not None:
        ax.axhline(load.capacity, color="tab:red", ls="--", lw=1, label="capacity")
    ax.set_xticks(list(experts))
    ax.set(xlabel="expert", ylabel="assignments",
           title=f"top-{top_k}, capacity factor {capacity_factor}: {load.dropped:.1%} dropped, "
                 f"{load.rerouted:.1%} rerouted")
    ax.legend(fontsize="small", frameon=False)
    return ax


def plot_capacity_sweep(logits: torch.Tensor, factors: Sequence[float] = (0.75, 1.0, 1.25, 1.5, 2.0, 3.0),
                        top_ks: Sequence[int] = (1, 2, 4), axes: Any = None) -> Any:
    """The widget's static version: share of assignments dropped (left) and the hottest expert's load over the
    mean after capping (right), against the capacity factor, for a few top-k."""
    axes = _axes(axes, 2, (12, 3.2))
    for i, k in enumerate(top_ks):
        loads = [capacity_load(logits, k, f, "drop") for f in factors]
        axes[0].plot(factors, [100 * load.dropped for load in loads], marker="o", color=f"C{i}", label=f"top-{k}")
        ratio = [(load.kept.max() / load.kept.float().mean()).item() for load in loads]
        axes[1].plot(factors, ratio, marker="o", color=f"C{i}", label=f"top-{k}")
        free = capacity_load(logits, k, None)
        axes[1].axhline((free.kept.max() / free.kept.float().mean()).item(), color=f"C{i}", ls=":", lw=1)
    axes[0].set(xlabel="capacity factor", ylabel="assignments dropped (%)", title="what a cap drops")
    axes[1].set(xlabel="capacity factor", ylabel="hottest expert / mean (kept)",
                title="how even the kept load is (dotted: no cap)")
    for ax in axes:
        ax.legend(fontsize="small", frameon=False)
    return axes


def routing_explorer(logits: torch.Tensor, title: str = "") -> Any:
    """Sliders for top-k and the capacity factor and a drop/reroute menu over recorded router ``logits`` (T, E):
    the load per expert and what the cap moved, redrawn on every change (needs a live kernel)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from minipd.viz.explorer import explorer_box

    experts = logits.shape[1]
    top_k = widgets.IntSlider(value=2, min=1, max=experts, description="top-k", continuous_update=False)
    factor = widgets.FloatSlider(value=1.25, min=0.5, max=4.0, step=0.25, description="capacity",
                                 continuous_update=False)
    policy = widgets.Dropdown(options=["drop", "reroute"], value="drop", description="overflow")
    out = widgets.Output()
    shown: list[CapacityLoad] = []

    def draw(_change: object = None) -> None:
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
            plot_capacity_load(logits, top_k.value, factor.value, policy.value, ax=ax)
            if title:
                fig.suptitle(title, fontsize=10)
            plt.show()
        shown[:] = [capacity_load(logits, top_k.value, factor.value, policy.value)]

    for control in (top_k, factor, policy):
        control.observe(draw, names="value")
    draw()

    explorer = explorer_box([widgets.HBox([top_k, factor, policy]), out], "routing explorer",
                            "the capacity sweep above is the static version")
    explorer.shown = shown  # the CapacityLoad drawn last
    return explorer
