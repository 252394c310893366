"""The router-only fine-tune: only routers move, each balancing method does what it says, and the
figures before and after are recorded and plotted."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from minipd.evaluation.router_training import finetune_routers, plot_balancing


@pytest.fixture(scope="module")
def runs():
    return {m: finetune_routers(m, steps=3, batch=2, seq=64, heldout_windows=1, progress=False, lr=1e-2)
            for m in ("none", "aux", "bias")}


def test_only_the_routers_train_and_the_bias_moves_with_the_bias_method(monkeypatch):
    import minipd.models as models
    from minipd.layers.moe import MoE

    captured = {}
    real = models.load_model  # finetune_routers imports it when called: spy on it there

    def spy(*args, **kwargs):
        model, folder = real(*args, **kwargs)
        captured["model"] = model
        captured["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return model, folder

    monkeypatch.setattr(models, "load_model", spy)
    finetune_routers("bias", steps=2, batch=1, seq=32, heldout_windows=1, progress=False, lr=1e-2, gamma=0.01)
    model = captured["model"]
    for name, param in model.named_parameters():
        moved = not torch.equal(param, captured["before"][name])
        assert moved == name.endswith("router.weight"), name
    routers = [m.router for m in model.modules() if isinstance(m, MoE)]
    assert all(r.selection_bias is not None and bool(r.selection_bias.abs().sum() > 0) for r in routers)


def test_each_run_records_its_curve_and_the_held_out_figures(runs):
    for method, run in runs.items():
        assert run.method == method and len(run.train_loss) == len(run.train_imbalance) == 3
        (l0, l1), (i0, i1) = run.heldout_loss, run.heldout_imbalance
        assert 3 < l0 < 6 and 3 < l1 < 6 and i0 >= 1 and i1 >= 1
    assert runs["none"].heldout_loss[0] == runs["aux"].heldout_loss[0]  # the same starting point
    assert runs["none"].train_loss != runs["aux"].train_loss  # the auxiliary loss changed the gradient
    axes = plot_balancing(list(runs.values()))
    assert len(axes[0].get_lines()) == len(axes[1].get_lines()) == 3
    with pytest.raises(ValueError, match="method must be one of 'none', 'aux', 'bias'"):
        finetune_routers("switch")
