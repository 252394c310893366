"""Build a :class:`DecoderModel` for a checkpoint folder and fill it with the checkpoint's weights."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from minipd.config import ModelConfig
from minipd.device import resolve_device, resolve_dtype
from minipd.models.decoder import DecoderModel
from minipd.models.registry import resolve_model
from minipd.models.weights import load_weights


@contextlib.contextmanager
def _meta_normal_is_a_no_op() -> Iterator[None]:
    """``torch.nn.init.normal_`` returns a meta tensor as it is.

    A meta tensor has no values, so nothing is lost; but torch's meta ``normal_`` imports the whole compiler
    (``torch._dynamo``: 1.5-2.5 s on the 2-core EPYC) the first time it runs, and ``nn.Embedding`` calls it
    while the model is built, so every engine paid that even when nothing was ever compiled.
    """
    original = torch.nn.init.normal_

    def normal_(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor if tensor.is_meta else original(tensor, *args, **kwargs)  # type: ignore[arg-type]

    torch.nn.init.normal_ = normal_  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.nn.init.normal_ = original


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
    with torch.device("meta"), _meta_normal_is_a_no_op():
        net = DecoderModel(config)
    net = net.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    net.rotary.reset_cache(device)
    load_weights(net, folder)
    return net.eval().requires_grad_(False), folder
