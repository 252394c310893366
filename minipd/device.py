"""Which device and dtype minipd runs on, and which kernel backends are available there."""

from __future__ import annotations

import importlib.util

import torch


def default_device() -> torch.device:
    """CUDA when present, otherwise the CPU. No code path assumes a GPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA (the dtype models ship in), fp32 on CPU (fast and exact there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def kernel_backends() -> dict[str, str]:
    """Each kernel backend and whether it can run here, in words."""
    backends = {"torch": "available (scaled_dot_product_attention)"}
    if importlib.util.find_spec("triton") is None:
        backends["triton"] = "not installed"
    elif torch.cuda.is_available():
        backends["triton"] = "available (compiled for CUDA)"
    else:
        backends["triton"] = "installed; runs on CPU only under TRITON_INTERPRET=1"
    return backends
