"""A model of one's own that shares another's weights: what an engine changes, it changes only for itself."""

from __future__ import annotations

import copy

import torch


def module_view(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree of modules whose parameters and buffers are the same tensors.

    An engine swaps layers (int8 or oneDNN-packed linears) and sets per-engine attributes (the MoE
    backend, routing logs) on its model; doing that on a view leaves the caller's model, and any other
    engine built on it, as they were, at the cost of the modules' Python objects only (no weight is
    copied). Other attributes (a config, an expert-parallel dispatcher) are shared, as they would be by
    two references to one model.
    """
    view = copy.copy(module)
    for name, value in module.__dict__.items():
        if isinstance(value, dict):  # parameter, buffer, child and hook registries: the view's own
            view.__dict__[name] = type(value)(value) if type(value) is not dict else dict(value)
    view._modules = {name: None if child is None else module_view(child)  # type: ignore[assignment]
                     for name, child in module._modules.items()}
    return view
