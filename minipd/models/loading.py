"""Build a :class:`DecoderModel` for a checkpoint folder and fill it with the checkpoint's weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minipd.config import ModelConfig
from minipd.device import resolve_device, resolve_dtype
from minipd.models.decoder import DecoderModel
from minipd.models.registry import resolve_model
from minipd.models.weights import load_weights


def load_model(model: str | os.PathLike, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None) -> tuple[DecoderModel, Path]:
    """Load ``model`` (bundled name, folder or hub id) for inference; returns the model and its folder.

    ``device`` and ``dtype`` are checked first (see :func:`~minipd.device.resolve_device` and
    :func:`~minipd.device.resolve_dtype`), so a missing GPU is a ``ValueError`` before any file is read.
    Parameters are created on the meta device and materialised once, on ``device`` in ``dtype``,
    so a large model is never initialised randomly first.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    folder = resolve_model(model)
    config = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        net = DecoderModel(config)
    net = net.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    net.rotary.reset_cache(device)
    load_weights(net, folder)
    return net.eval().requires_grad_(False), folder
