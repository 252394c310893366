"""Conceptual diagrams drawn by code: the engine map, a request's life, prefill vs decode, paged KV.

These are pictures of ideas, not of measurements: every box, arrow and label is placed by hand so the
figures read well at notebook width (about 9 inches). Each function draws on given Axes (or new ones)
and returns them. So that tests and readers can find what was drawn, every box is a patch whose
``gid`` names it (``"part:scheduler"``, ``"physical:7"``, ...), and its text is in ``ax.texts``.

matplotlib is imported inside the functions: ``import minipd`` never pays for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "CHAPTER_PARTS",
    "ENGINE_PARTS",
    "GREY",
    "GROUP_COLORS",
    "PAGED_EXAMPLE",
    "REQUEST_STAGES",
    "EnginePart",
    "engine_parts",
    "plot_engine_map",
    "plot_paged_kv",
    "plot_prefill_decode_flow",
    "plot_request_path",
]

#: Box colours per group of the engine; greyed boxes are drawn in :data:`GREY`.
GROUP_COLORS = {"front": "#cfe2f3", "core": "#d9ead3", "model": "#fde2b8", "scale": "#e4d7f0"}
GREY = "0.95"
GREY_EDGE = "0.75"
GREY_TEXT = "0.6"
#: Prefill and decode colours, matching :mod:`minipd.viz.latency` (TTFT orange, TPOT blue).
PREFILL_COLOR = "#fbd3a4"
DECODE_COLOR = "#c6dbef"


@dataclass(frozen=True)
class EnginePart:
    """One box of the engine map: its title, a line of detail, the chapter(s) that build it, its group."""

    title: str
    detail: str
    chapter: str
    group: str


#: Every part of the engine map, by name (the names ``highlight`` accepts).
ENGINE_PARTS: dict[str, EnginePart] = {
    "server": EnginePart("server", "HTTP, streaming, load", "08", "scale"),
    "LLM": EnginePart("LLM", "generate · stream · abort", "00", "front"),
    "tokenizer": EnginePart("tokenizer", "text ↔ token ids", "01", "front"),
    "output processor": EnginePart("output processor", "detokenize, stop, metrics", "00", "front"),
    "scheduler": EnginePart("scheduler", "token budget, preemption", "04", "core"),
    "block manager": EnginePart("block manager", "ref counts, prefix hashes", "03", "core"),
    "KV pool": EnginePart("paged KV pool", "fixed-size blocks", "03", "core"),
    "KV compression": EnginePart("KV compression", "quantize, evict", "06", "core"),
    "model runner": EnginePart("model runner", "batch → flat tensors", "02", "model"),
    "attention": EnginePart("attention", "paged kernel", "01 · 03b", "model"),
    "MLP / MoE": EnginePart("MLP / MoE", "dense or routed experts", "01 · 07", "model"),
    "sampler": EnginePart("sampler", "greedy, top-k/p, seed", "01", "model"),
    "prefill worker": EnginePart("prefill worker", "prompt → 1st token", "05", "scale"),
    "KV transfer": EnginePart("KV transfer", "blocks between workers", "05", "scale"),
    "decode worker": EnginePart("decode worker", "the other tokens", "05", "scale"),
    "expert parallel": EnginePart("expert parallel", "experts across GPUs", "07", "scale"),
}

#: The parts each chapter builds (or, for 00, shows): what ``highlight="03"`` colours.
CHAPTER_PARTS: dict[str, tuple[str, ...]] = {
    "00": tuple(ENGINE_PARTS),
    "01": ("tokenizer", "attention", "MLP / MoE", "sampler"),
    "02": ("model runner", "attention", "MLP / MoE", "output processor"),
    "03": ("block manager", "KV pool", "attention"),
    "03b": ("attention", "KV pool"),
    "04": ("scheduler", "model runner"),
    "05": ("prefill worker", "KV transfer", "decode worker"),
    "05b": ("prefill worker", "KV transfer", "decode worker"),
    "06": ("KV compression", "KV pool", "KV transfer"),
    "07": ("MLP / MoE", "expert parallel"),
    "08": ("server", "LLM"),
}

# Where each box sits: (x centre, y centre, width), in the map's coordinates (13 x 8.2).
_LAYOUT: dict[str, tuple[float, float, float]] = {
    "server": (6.6, 7.45, 2.6),
    "tokenizer": (1.5, 5.85, 2.3),
    "LLM": (6.6, 5.85, 4.6),
    "output processor": (11.75, 5.85, 2.5),
    "scheduler": (1.5, 4.05, 2.3),
    "block manager": (4.3, 4.05, 2.4),
    "KV pool": (7.2, 4.05, 2.3),
    "KV compression": (9.9, 4.05, 2.3),
    "model runner": (1.5, 2.25, 2.3),
    "attention": (6.1, 2.15, 2.0),
    "MLP / MoE": (8.5, 2.15, 2.0),
    "sampler": (11.75, 2.25, 2.3),
    "prefill worker": (1.5, 0.45, 2.3),
    "KV transfer": (4.3, 0.45, 2.4),
    "decode worker": (7.1, 0.45, 2.3),
    "expert parallel": (9.9, 0.45, 2.3),
}
_BOX_HEIGHT = 0.95


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=figsize)
    # Room at the top for the title; the diagrams set their own limits and hide the axes.
    return fig.add_axes((0.01, 0.01, 0.98, 1 - 0.45 / figsize[1]))


def _box(ax: Axes, x: float, y: float, w: float, h: float, face: str, edge: str = "0.3", lw: float = 1.0,
         gid: str | None = None, style: str = "round,pad=0.02,rounding_size=0.12", ls: str = "-",
         zorder: float = 2) -> Any:
    """A rounded box with its lower-left corner at (x, y)."""
    from matplotlib.patches import FancyBboxPatch

    patch = FancyBboxPatch((x, y), w, h, boxstyle=style, fc=face, ec=edge, lw=lw, ls=ls, zorder=zorder)
    patch.set_gid(gid)
    ax.add_patch(patch)
    return patch


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], color: str = "0.35",
           style: str = "-|>", lw: float = 1.1, ls: str = "-", rad: float = 0.0, gid: str | None = None,
           zorder: float = 1) -> Any:
    from matplotlib.patches import FancyArrowPatch

    patch = FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=11, color=color, lw=lw, ls=ls,
                            connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0, zorder=zorder)
    patch.set_gid(gid)
    ax.add_patch(patch)
    return patch


def _note(ax: Axes, x: float, y: float, text: str, size: float = 7.5, color: str = "0.3", **kwargs: Any) -> None:
    """A small label beside an arrow, on a white background so lines behind it do not cross the text."""
    ax.text(x, y, text, fontsize=size, color=color, ha=kwargs.pop("ha", "center"), va=kwargs.pop("va", "center"),
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9}, zorder=4, **kwargs)


# --- the engine map -------------------------------------------------------------------------------


def _chapter_key(key: str) -> str:
    """``"ch3"``, ``"3"`` and ``"03"`` all name chapter ``"03"``; ``"3b"`` names ``"03b"``."""
    key = key.removeprefix("ch")
    digits = len(key) - len(key.lstrip("0123456789"))
    return key.zfill(len(key) - digits + 2) if 0 < digits < 2 else key


def engine_parts(highlight: str | Iterable[str] | None) -> set[str]:
    """The part names ``highlight`` means: a chapter key (``"03"``, ``"ch03"``, ``"3"``), a part name, a
    list of either, or None (every part).

    Raises:
        ValueError: for a name that is neither a chapter nor a part.
    """
    if highlight is None:
        return set(ENGINE_PARTS)
    items = [highlight] if isinstance(highlight, str) else list(highlight)
    chosen: set[str] = set()
    for item in items:
        key = str(item)
        chapter = _chapter_key(key)
        if key in ENGINE_PARTS:
            chosen.add(key)
        elif chapter in CHAPTER_PARTS:
            chosen.update(CHAPTER_PARTS[chapter])
        else:
            raise ValueError(f"unknown part or chapter {item!r}; chapters: {sorted(CHAPTER_PARTS)}, "
                             f"parts: {sorted(ENGINE_PARTS)}")
    return chosen


def plot_engine_map(highlight: str | Iterable[str] | None = None, ax: Axes | None = None,
                    title: str | None = None) -> Axes:
    """The whole engine as boxes and arrows, with the parts a chapter builds in colour and the rest grey.

    Top to bottom: the front end (``LLM``, tokenizer, output processor, and the chapter-08 server above
    it), the engine core (scheduler, block manager, paged KV pool, KV compression), the forward pass
    (model runner, the model's attention and MLP/MoE, sampler), and a band of what spreads the engine
    over processes and GPUs (prefill and decode workers with the KV transfer between them; expert
    parallelism). Each box carries a tag with the chapter that builds it.

    Every box is a patch with gid ``"part:<name>"`` (names: :data:`ENGINE_PARTS`); a highlighted box
    is filled with its group's colour (:data:`GROUP_COLORS`), any other with :data:`GREY`.

    Args:
        highlight: a chapter key (``"03"``), a part name, a list of either, or None for every part in colour.
        ax: Axes to draw on; a new 9 x 5.6 inch figure is made when None.
        title: the title; by default one naming the chapter.

    Returns:
        The Axes drawn on.
    """
    chosen = engine_parts(highlight)
    ax = _new_axes(ax, (9, 5.7))
    h = _BOX_HEIGHT
    # The model: a container around attention and MLP, "× layers".
    model_on = bool({"attention", "MLP / MoE"} & chosen)
    _box(ax, 4.85, 1.42, 4.9, 1.55, "white" if model_on else "0.985", edge="0.45" if model_on else GREY_EDGE,
         ls="--", gid="group:model", zorder=1)
    ax.text(9.65, 2.9, "model: decoder layers × N", ha="right", va="top", fontsize=7.5,
            color="0.3" if model_on else GREY_TEXT, zorder=3)
    # The band of parts that spread the engine over processes and GPUs.
    ax.plot([0.2, 12.9], [1.18, 1.18], color="0.7", lw=0.8, ls=":", zorder=0)
    ax.text(12.9, 0.45, "across\nprocesses\nand GPUs", ha="right", va="center", fontsize=7.5, style="italic",
            color="0.45")

    for name, part in ENGINE_PARTS.items():
        x, y, w = _LAYOUT[name]
        on = name in chosen
        face = GROUP_COLORS[part.group] if on else GREY
        edge = "0.2" if on and highlight is not None else ("0.35" if on else GREY_EDGE)
        _box(ax, x - w / 2, y - h / 2, w, h, face, edge=edge, lw=1.6 if on and highlight is not None else 0.9,
             gid=f"part:{name}")
        ax.text(x, y + 0.17, part.title, ha="center", va="center", fontsize=9.5, weight="bold",
                color="black" if on else GREY_TEXT, zorder=3)
        ax.text(x, y - 0.2, part.detail, ha="center", va="center", fontsize=7.5,
                color="0.25" if on else GREY_TEXT, zorder=3)
        ax.text(x + w / 2 - 0.06, y + h / 2, f"ch{part.chapter}", ha="right", va="center", fontsize=6.5,
                color="0.3" if on else GREY_TEXT, zorder=4,
                bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": "0.55" if on else GREY_EDGE, "lw": 0.6})

    def side(name: str, where: str, shift: float = 0.0) -> tuple[float, float]:
        x, y, w = _LAYOUT[name]
        return {"left": (x - w / 2 - 0.03, y + shift), "right": (x + w / 2 + 0.03, y + shift),
                "top": (x + shift, y + h / 2 + 0.03), "bottom": (x + shift, y - h / 2 - 0.03)}[where]

    def link(a: tuple[float, float], b: tuple[float, float], label: str | None = None,
             at: tuple[float, float] | None = None, both: bool = False, ls: str = "-") -> None:
        _arrow(ax, a, b, style="<|-|>" if both else "-|>", ls=ls)
        if label:
            mid = at if at is not None else ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
            _note(ax, *mid, label)

    link(side("server", "bottom"), side("LLM", "top"), "requests ↓  tokens ↑", at=(6.6, 6.69), both=True)
    link(side("LLM", "left"), side("tokenizer", "right"), "prompt")
    link(side("output processor", "left"), side("LLM", "right"), "outputs")
    link(side("tokenizer", "bottom"), side("scheduler", "top"), "token ids", at=(1.5, 4.95))
    link(side("scheduler", "right"), side("block manager", "left"))
    link(side("block manager", "right"), side("KV pool", "left"))
    link(side("KV compression", "left"), side("KV pool", "right"))
    link(side("scheduler", "bottom"), side("model runner", "top"), "batch", at=(1.5, 3.15))
    link(side("model runner", "right"), (side("attention", "left")[0], 2.25))
    _arrow(ax, (6.6, _LAYOUT["attention"][1] + h / 2 + 0.03), (6.6, _LAYOUT["KV pool"][1] - h / 2 - 0.03),
           style="<|-|>")
    _note(ax, 6.6, 3.22, "K/V")
    link(side("attention", "right"), side("MLP / MoE", "left"))
    link((side("MLP / MoE", "right")[0], 2.25), side("sampler", "left"), "logits", at=(10.05, 2.5))
    link(side("sampler", "top"), side("output processor", "bottom"), "token ids", at=(11.75, 4.05))
    link(side("prefill worker", "right"), side("KV transfer", "left"))
    link(side("KV transfer", "right"), side("decode worker", "left"))
    # MoE layers reach other GPUs' experts through expert parallelism.
    link(side("MLP / MoE", "bottom", 0.6), side("expert parallel", "top", -0.8), ls=":")

    if title is None:
        if highlight is None:
            title = "minipd's engine: every part, tagged with the chapter that builds it"
        elif isinstance(highlight, str) and highlight not in ENGINE_PARTS:
            title = f"chapter {_chapter_key(highlight)} builds the parts in colour"
        else:
            title = "the engine map: the parts in colour"
    ax.set_title(title, fontsize=10.5, loc="left")
    ax.set(xlim=(0.1, 13.15), ylim=(-0.1, 8.0))
    ax.axis("off")
    return ax


# --- a request's life -----------------------------------------------------------------------------

#: The stages of :func:`plot_request_path`, in order: (name, title, detail, colour).
REQUEST_STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("prompt", "prompt", '"def fib(n):"', GROUP_COLORS["front"]),
    ("tokenize", "tokenize", "text → token ids", GROUP_COLORS["front"]),
    ("waiting", "waiting queue", "no KV blocks yet", "0.9"),
    ("prefill", "prefill", "whole prompt, or in chunks", PREFILL_COLOR),
    ("decode", "decode steps", "1 token per step", DECODE_COLOR),
    ("sample", "sampled tokens", "one per step", GROUP_COLORS["model"]),
    ("stream", "detokenize, stream", "text to the user", GROUP_COLORS["front"]),
    ("finished", "finished", "blocks freed", GROUP_COLORS["core"]),
)


def plot_request_path(ax: Axes | None = None) -> Axes:
    """A request's life, as a path of eight boxes in two rows, with preemption as a side path.

    Top row, left to right: prompt → tokenize → waiting queue → prefill (scheduled, maybe in chunks);
    bottom row, right to left: decode steps → sampled tokens → detokenize / stream → finished (blocks
    freed). A loop returns from the sampled token to the next decode step; a dashed red arrow takes a
    preempted request from decode back to the waiting queue. Boxes have gid ``"stage:<name>"`` (names:
    :data:`REQUEST_STAGES`); the preemption arrow has gid ``"preemption"``.

    Returns:
        The Axes drawn on.
    """
    ax = _new_axes(ax, (9, 3.6))
    w, h = 2.25, 0.95
    xs = [1.35, 4.25, 7.15, 10.05]
    top, bottom = 3.0, 0.95
    places = {}
    for i, (name, title, detail, color) in enumerate(REQUEST_STAGES):
        x, y = (xs[i], top) if i < 4 else (xs[7 - i], bottom)
        places[name] = (x, y)
        _box(ax, x - w / 2, y - h / 2, w, h, color, gid=f"stage:{name}")
        ax.text(x, y + 0.17, title, ha="center", va="center", fontsize=9.5, weight="bold", zorder=3)
        ax.text(x, y - 0.2, detail, ha="center", va="center", fontsize=7.5, color="0.25", zorder=3)

    def right(name: str) -> tuple[float, float]:
        return places[name][0] + w / 2 + 0.04, places[name][1]

    def left(name: str) -> tuple[float, float]:
        return places[name][0] - w / 2 - 0.04, places[name][1]

    for a, b in (("prompt", "tokenize"), ("tokenize", "waiting"), ("waiting", "prefill")):
        _arrow(ax, right(a), left(b))
    _note(ax, 8.6, top + 0.75, "scheduled:\nblocks allocated", size=7)
    for a, b in (("decode", "sample"), ("sample", "stream"), ("stream", "finished")):
        _arrow(ax, left(a), right(b))
    # prefill → decode: the first token is sampled by the prefill step.
    px, py = places["prefill"]
    _arrow(ax, (px + 0.35, py - h / 2 - 0.04), (px + 0.35, bottom + h / 2 + 0.04))
    _note(ax, px + 0.4, (top + bottom) / 2, "1st token (TTFT)", ha="left", size=7)
    # Chunked prefill: the prefill box loops onto itself until the whole prompt is in the cache.
    _arrow(ax, (px + 0.6, py + h / 2 + 0.04), (px - 0.6, py + h / 2 + 0.04), rad=0.9, lw=1.0)
    _note(ax, px, py + h / 2 + 0.55, "next chunk", size=7)
    # The decode loop: the sampled token is the next step's input, until a stop condition.
    sx, dx = places["sample"][0], places["decode"][0]
    _arrow(ax, (sx + 0.3, bottom - h / 2 - 0.04), (dx - 0.3, bottom - h / 2 - 0.04), rad=0.35, lw=1.0)
    _note(ax, (sx + dx) / 2, bottom - h / 2 - 0.55, "not done: next step (TPOT)", size=7)
    _note(ax, (places["stream"][0] + places["finished"][0]) / 2, bottom - 0.75, "stop or\nmax_tokens", size=7)
    # Preemption: the pool is full, the newest request gives its blocks back and queues again.
    wx = places["waiting"][0]
    _arrow(ax, (dx - w / 2 + 0.15, bottom + h / 2 + 0.04), (wx + 0.3, top - h / 2 - 0.04), color="tab:red",
           ls="--", rad=-0.15, gid="preemption")
    _note(ax, 7.3, (top + bottom) / 2, "preempted: pool full,\nblocks freed, recomputed later",
          color="tab:red", size=7, ha="right")
    ax.set_title("a request's life in the engine", fontsize=10.5, loc="left")
    ax.set(xlim=(0, 11.4), ylim=(-0.35, 4.4))
    ax.axis("off")
    return ax


# --- prefill vs decode ----------------------------------------------------------------------------


def plot_prefill_decode_flow(ax: Axes | None = None, prompt_tokens: int = 6) -> Axes:
    """Prefill and decode side by side: what goes in, what the forward pass reads and writes, what comes out.

    Left, **prefill**: ``N`` prompt tokens in one forward pass (hidden ``[N, d]``, logits ``[N, V]``,
    of which the last row gives the first token), the K/V of all ``N`` written to the cache; each
    weight read serves ``N`` tokens, so it is compute-bound and sets TTFT. Right, **decode**: one token
    (``[1, d]``, logits ``[1, V]``), all cached K/V and all weights read, one K/V written; memory-bound,
    it sets TPOT. Cache cells have gid ``"prefill:write"``, ``"decode:read"`` and ``"decode:write"``.

    Args:
        ax: Axes to draw on; a new 9 x 4.6 inch figure is made when None.
        prompt_tokens: how many prompt tokens to draw (``N``), 2 to 10.

    Returns:
        The Axes drawn on.
    """
    if not 2 <= prompt_tokens <= 10:
        raise ValueError(f"prompt_tokens must be 2 to 10 to fit the drawing, got {prompt_tokens}")
    ax = _new_axes(ax, (9, 4.7))
    n = prompt_tokens
    cell = 0.34

    def tokens(x0: float, y: float, labels: Sequence[str], color: str) -> None:
        for i, label in enumerate(labels):
            _box(ax, x0 + i * (cell + 0.06), y, cell, cell, color, style="square,pad=0", lw=0.8)
            ax.text(x0 + i * (cell + 0.06) + cell / 2, y + cell / 2, label, ha="center", va="center",
                    fontsize=7, zorder=3)

    def cache(x0: float, y: float, kinds: Sequence[str], gid_prefix: str) -> None:
        """Cache cells in rows of five: ``"write"`` (new K/V), ``"read"`` (cached K/V read), ``"free"``."""
        colors = {"write": "tab:orange", "read": "tab:blue", "free": "white"}
        for i, kind in enumerate(kinds):
            r, c = divmod(i, 5)
            _box(ax, x0 + c * (cell + 0.05), y - r * (cell + 0.05), cell, cell, colors[kind], style="square,pad=0",
                 lw=0.7, edge="0.3", gid=None if kind == "free" else f"{gid_prefix}:{kind}")

    left, right = 0.3, 7.45
    ax.text(left, 7.35, "prefill: the whole prompt in one step", fontsize=10.5, weight="bold", va="center")
    ax.text(right, 7.35, "decode: one token per step", fontsize=10.5, weight="bold", va="center")
    tokens(left, 6.3, [f"t{i + 1}" for i in range(n)], PREFILL_COLOR)
    ax.text(left + n * (cell + 0.06) + 0.1, 6.47, f"N = {n} prompt tokens: ids [N]", fontsize=8, va="center")
    tokens(right, 6.3, [f"t{n + 3}"], DECODE_COLOR)
    ax.text(right + cell + 0.16, 6.47, "the last sampled token: ids [1]", fontsize=8, va="center")
    slots = 10
    for phase, x0, color in (("prefill", left, PREFILL_COLOR), ("decode", right, DECODE_COLOR)):
        rows = ("[N, d]", "[N, V]") if phase == "prefill" else ("[1, d]", "[1, V]")
        _arrow(ax, (x0 + 0.3, 6.22), (x0 + 0.3, 5.6))
        _box(ax, x0, 4.15, 3.4, 1.4, color, gid=f"{phase}:forward")
        ax.text(x0 + 1.7, 5.2, "one forward pass", ha="center", fontsize=9.5, weight="bold", zorder=3)
        ax.text(x0 + 1.7, 4.8, f"hidden {rows[0]}, every layer", ha="center", fontsize=8, zorder=3)
        ax.text(x0 + 1.7, 4.42, "all weights read once", ha="center", fontsize=8, zorder=3)
        _arrow(ax, (x0 + 0.3, 4.08), (x0 + 0.3, 3.45))
        _box(ax, x0, 2.7, 3.4, 0.7, "white", gid=f"{phase}:logits")
        last = "; last row → 1st token" if phase == "prefill" else " → next token"
        ax.text(x0 + 1.7, 3.05, f"logits {rows[1]}{last}", ha="center", va="center", fontsize=8, zorder=3)
        # The KV cache beside the forward pass.
        cx = x0 + 3.85
        ax.text(cx, 5.62, "KV cache", fontsize=8.5, weight="bold")
        if phase == "prefill":
            kinds, caption, style = ["write"] * n + ["free"] * (slots - n), f"K/V of all {n}\nwritten", "-|>"
        else:
            kinds = ["read"] * (n + 2) + ["write"] + ["free"] * max(0, slots - n - 3)
            caption, style = f"all {n + 2} cached read,\n1 written", "<|-|>"
        cache(cx, 5.05, kinds, phase)
        ax.text(cx, 4.55 - (len(kinds) - 1) // 5 * (cell + 0.05) + cell, caption, fontsize=8, va="top")
        _arrow(ax, (x0 + 3.45, 4.95), (cx - 0.08, 4.95), style=style)
    # Decode loops: the sampled token is the next step's input.
    _arrow(ax, (right - 0.05, 3.05), (right - 0.05, 6.47), rad=-0.25, color="tab:blue", lw=1.0)
    ax.text(right + 0.45, 3.75, "↻ next token: the next step's input", fontsize=7.5, color="tab:blue", va="center")
    # What bounds each phase, and the latency it sets.
    verdicts = (
        (left, PREFILL_COLOR, "compute-bound: each weight read serves N tokens",
         "≈ 2 · params · N FLOPs per step  →  sets TTFT"),
        (right, DECODE_COLOR, "memory-bound: all weights and all K/V read",
         "for 1 token per step  →  sets TPOT"),
    )
    for x0, color, first, second in verdicts:
        _box(ax, x0, 0.55, 5.75, 1.25, color, lw=1.3, edge="0.2")
        ax.text(x0 + 0.15, 1.45, first, fontsize=8.5, weight="bold", va="center", zorder=3)
        ax.text(x0 + 0.15, 0.95, second, fontsize=8.5, va="center", zorder=3)
    ax.plot([6.75, 6.75], [0.4, 7.5], color="0.7", lw=0.8, zorder=0)
    ax.set(xlim=(0, 13.4), ylim=(0.3, 7.65))
    ax.axis("off")
    return ax


# --- paged KV -------------------------------------------------------------------------------------

#: The default picture: three sequences (tokens held, block table); A and B share their first block.
PAGED_EXAMPLE: dict[str, tuple[int, tuple[int, ...]]] = {
    "A": (37, (7, 2, 9)),
    "B": (27, (7, 4)),
    "C": (19, (0, 10)),
}


def plot_paged_kv(sequences: Mapping[str, tuple[int, Sequence[int]]] | None = None, num_blocks: int = 12,
                  block_size: int = 16, ax: Axes | None = None) -> Axes:
    """Block tables mapping each sequence's logical blocks to physical blocks of a shared pool.

    Left, each sequence's logical blocks (the last one partly filled) and its block table; right, the
    pool, with an arrow from every logical block to the physical block holding it. A physical block
    referenced by more than one sequence is a shared prefix (prefix caching: one copy, a reference
    count); a block no table references is free. Physical blocks have gid ``"physical:<id>"`` and are
    coloured by owner, shared ones hatched and free ones white; logical blocks have gid
    ``"logical:<seq>:<index>"``; arrows have gid ``"map:<seq>:<index>"``.

    Args:
        sequences: name -> (tokens held, block table); by default :data:`PAGED_EXAMPLE`.
        num_blocks: blocks in the pool, drawn in one row (at most 16 draw well).
        block_size: tokens per block.
        ax: Axes to draw on; a new 9 x 3.7 inch figure is made when None.

    Returns:
        The Axes drawn on.
    """
    sequences = dict(PAGED_EXAMPLE if sequences is None else sequences)
    if not sequences:
        raise ValueError("plot_paged_kv needs at least one sequence")
    for name, (num_tokens, table) in sequences.items():
        if len(table) != math.ceil(num_tokens / block_size):
            raise ValueError(f"sequence {name!r}: {num_tokens} tokens need {math.ceil(num_tokens / block_size)} "
                             f"blocks of {block_size}, its table has {len(table)}")
        if any(not 0 <= b < num_blocks for b in table):
            raise ValueError(f"sequence {name!r}: block ids must be in 0..{num_blocks - 1}, got {list(table)}")
    refs: dict[int, list[str]] = {}
    for name, (_, table) in sequences.items():
        for b in table:
            refs.setdefault(b, []).append(name)
    palette = ["#9ecae1", "#a1d99b", "#fdae6b", "#bcbddc", "#fc9272", "#d9d9d9"]
    colors = {name: palette[i % len(palette)] for i, name in enumerate(sequences)}

    ax = _new_axes(ax, (9, 3.7))
    gap = 0.12
    side = min(0.9, 12.6 / num_blocks - gap)
    pool_x, pool_y = 0.3, 0.95
    centers: dict[int, float] = {}
    for b in range(num_blocks):
        x = pool_x + b * (side + gap)
        owners = refs.get(b, [])
        face = colors[owners[0]] if owners else "white"
        patch = _box(ax, x, pool_y, side, side, face, style="square,pad=0", gid=f"physical:{b}",
                     edge="0.3" if owners else "0.6")
        if len(owners) > 1:
            patch.set_hatch("///")
        centers[b] = x + side / 2
        ax.text(x + side / 2, pool_y + side - 0.17, str(b), ha="center", va="center", fontsize=8, weight="bold",
                zorder=3)
        state = "free" if not owners else (f"ref {len(owners)}" if len(owners) > 1 else ", ".join(owners))
        ax.text(x + side / 2, pool_y + side * 0.32, state, ha="center", va="center", fontsize=7.5,
                color="0.45" if not owners else "black", zorder=3,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none"} if len(owners) > 1 else None)
    ax.text(pool_x, pool_y - 0.1, f"physical KV pool: {num_blocks} blocks of {block_size} tokens", fontsize=9,
            weight="bold", va="top")

    cell_w, cell_h, seq_y = 0.62, 0.5, 3.05
    x = 0.3
    for name, (num_tokens, table) in sequences.items():
        ax.text(x, seq_y + cell_h + 0.08, f"sequence {name}: {num_tokens} tokens\nblock table {list(table)}",
                fontsize=8, va="bottom")
        for i, b in enumerate(table):
            filled = min(block_size, num_tokens - i * block_size) / block_size
            _box(ax, x, seq_y, cell_w, cell_h, "white", style="square,pad=0", gid=f"logical:{name}:{i}")
            _box(ax, x, seq_y, cell_w * filled, cell_h, colors[name], style="square,pad=0", lw=0, zorder=2.1)
            ax.text(x + cell_w / 2, seq_y + cell_h / 2, f"L{i}", ha="center", va="center", fontsize=8, zorder=3)
            _arrow(ax, (x + cell_w / 2, seq_y - 0.03), (centers[b], pool_y + side + 0.03), color="0.4", lw=0.9,
                   gid=f"map:{name}:{i}", zorder=1.5)
            x += cell_w + 0.08
        x += max(0.9, 2.9 - len(table) * (cell_w + 0.08))
    shared = sorted(b for b, owners in refs.items() if len(owners) > 1)
    free = [b for b in range(num_blocks) if b not in refs]
    notes = [f"logical block Li: the sequence's tokens {block_size}·i to {block_size}·i + {block_size - 1}"]
    if shared:
        notes.append(f"shared prefix: block {', '.join(map(str, shared))} stored once, referenced by "
                     f"{' and '.join(refs[shared[0]])} (hatched)")
    notes.append(f"free: {len(free)} blocks, for any sequence")
    ax.text(12.9, pool_y - 0.1, "\n".join(notes), fontsize=7.5, color="0.3", va="top", ha="right")
    ax.set_title("paged KV: block tables map logical blocks to physical blocks anywhere in the pool",
                 fontsize=10.5, loc="left")
    ax.set(xlim=(0, 13.1), ylim=(0.15, 4.2))
    ax.axis("off")
    return ax
