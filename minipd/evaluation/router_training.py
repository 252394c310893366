"""Balancing the load at training time: a short router-only fine-tune, three ways.

Every weight of the model but the routers is frozen, and the routers are trained on next-token loss
over Python standard-library source (the corpus the bundled models learned from) with one of:

- ``"none"``: the language-model loss alone;
- ``"aux"``: plus the Switch Transformer's auxiliary loss, ``alpha * E * sum_e f_e * P_e`` per layer,
  where ``f_e`` is the share of assignments expert ``e`` got and ``P_e`` its mean router probability:
  smallest when both are even. Its gradient pulls against the language-model loss;
- ``"bias"``: DeepSeek-V3's loss-free balancing: the routers train on the language-model loss alone,
  and after every step each expert's *selection bias* moves by ``gamma`` toward balance (down if it
  got more than the mean load, up if less). The bias only changes which experts win, never the weights.

:func:`finetune_routers` returns the training curve and the held-out loss and load imbalance before
and after, which :func:`plot_balancing` draws.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

METHODS = ("none", "aux", "bias")


@dataclass
class BalancingRun:
    """One fine-tune: per-step training loss and load imbalance, and held-out figures before and after."""

    method: str
    train_loss: list[float] = field(default_factory=list)
    train_imbalance: list[float] = field(default_factory=list)
    #: Held-out next-token loss and mean over layers of (hottest expert's load / mean load), before, after.
    heldout_loss: tuple[float, float] = (math.nan, math.nan)
    heldout_imbalance: tuple[float, float] = (math.nan, math.nan)


def stdlib_tokens(tokenizer, max_tokens: int = 200_000) -> torch.Tensor:
    """Tokens of the standard library's modules (tests left out), in a fixed order, up to ``max_tokens``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
    ids: list[int] = []
    for path in sorted(root.glob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        ids.extend(tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")))
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens])


def _loss_and_routing(model, batch: torch.Tensor, captured: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """Mean next-token loss over ``batch`` (B, S), and per MoE layer (router probabilities, chosen ids)."""
    losses, routing = [], []
    for row in batch:
        captured.clear()
        hidden = model(row, torch.arange(row.shape[0]))
        logits = model.compute_logits(hidden)
        losses.append(F.cross_entropy(logits[:-1], row[1:]))
        routing.append(list(captured))
    per_layer = [(torch.cat([r[i][0] for r in routing]), torch.cat([r[i][1] for r in routing]))
                 for i in range(len(routing[0]))]
    return torch.stack(losses).mean(), per_layer


def _imbalance(per_layer: list, num_experts: int) -> float:
    ratios = []
    for _, ids in per_layer:
        load = torch.bincount(ids.reshape(-1), minlength=num_experts).float()
        ratios.append((load.max() / load.mean()).item())
    return sum(ratios) / len(ratios)


def finetune_routers(method: str = "bias", model_name: str = "tiny-py-moe", steps: int = 60, batch: int = 4,
                     seq: int = 128, lr: float = 3e-3, alpha: float = 0.05, gamma: float = 1e-3,
                     heldout_windows: int = 4, seed: int = 0, progress: bool = True) -> BalancingRun:
    """Fine-tune only the routers of ``model_name`` with balancing ``method`` (see the module docstring)."""
    from tqdm.auto import tqdm

    from minipd.evaluation.kv_quality import windows
    from minipd.layers.moe import MoE
    from minipd.models import load_model
    from minipd.tokenizer import Tokenizer

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    torch.manual_seed(seed)
    model, folder = load_model(model_name, device="cpu", dtype=torch.float32)
    tokenizer = Tokenizer(folder)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"{model_name} has no mixture-of-experts layers to balance")
    num_experts = layers[0].router.num_experts
    for p in model.parameters():
        p.requires_grad_(False)
    routers = [layer.router for layer in layers]
    for router in routers:
        router.weight.requires_grad_(True)
        if method == "bias":
            router.selection_bias = torch.zeros(num_experts)
    captured: list = []

    def capture(router, args, output):  # (probabilities with their gradient, the ids chosen)
        captured.append((router.probabilities(args[0]), output[1]))

    hooks = [router.register_forward_hook(capture) for router in routers]
    heldout = torch.tensor(windows(tokenizer, 256, heldout_windows))
    run = BalancingRun(method)
    try:
        with torch.no_grad():
            loss, routing = _loss_and_routing(model, heldout, captured)
        before = (loss.item(), _imbalance(routing, num_experts))
        data = stdlib_tokens(tokenizer)
        optimizer = torch.optim.AdamW([r.weight for r in routers], lr=lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(seed)
        for _ in tqdm(range(steps), desc=f"router fine-tune ({method})", disable=not progress):
            starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
            rows = torch.stack([data[s:s + seq] for s in starts.tolist()])
            loss, routing = _loss_and_routing(model, rows, captured)
            total = loss
            if method == "aux":
                for probs, ids in routing:
                    share = torch.bincount(ids.reshape(-1), minlength=num_experts).float() / (ids.numel() or 1)
                    total = total + alpha * num_experts * (share * probs.mean(0)).sum()
            optimizer.zero_grad()
            total.backward()
            optimizer.step()
            if method == "bias":
                with torch.no_grad():
                    for router, (_, ids) in zip(routers, routing, strict=True):
                        load = torch.bincount(ids.reshape(-1), minlength=num_experts).float()
                        router.selection_bias += gamma * torch.sign(load.mean() - load)  # type: ignore[operator]
            run.train_loss.append(loss.item())
            run.train_imbalance.append(_imbalance(routing, num_experts))
        with torch.no_grad():
            loss, routing = _loss_and_routing(model, heldout, captured)
        run.heldout_loss = (before[0], loss.item())
        run.heldout_imbalance = (before[1], _imbalance(routing, num_experts))
    finally:
        for hook in hooks:
            hook.remove()
    return run


def plot_balancing(runs: list[BalancingRun], axes=None):
    """Training loss and load imbalance per step for each method; the held-out figures in the legend."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
    for run in runs:
        (loss0, loss1), (imb0, imb1) = run.heldout_loss, run.heldout_imbalance
        label = f"{run.method}: held-out loss {loss0:.3f}→{loss1:.3f}, max/mean load {imb0:.2f}→{imb1:.2f}"
        axes[0].plot(run.train_loss, label=label)
        axes[1].plot(run.train_imbalance, label=run.method)
    axes[0].set(xlabel="step", ylabel="next-token loss (train batch)")
    axes[1].set(xlabel="step", ylabel="hottest expert / mean load")
    # Beneath the panels: a legend inside would hide the curves' dips.
    axes[0].legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=len(runs), frameon=False)
    return axes
