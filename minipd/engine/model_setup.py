"""What an engine does to its view of the model before it runs it: MoE settings, int8 weights, packed linears.

Each engine works on its own view of the model (:func:`minipd.models.view.module_view`: same weight
tensors, its own modules), so what these change stays the engine's.
"""

from __future__ import annotations

import os

import torch

from minipd.engine.config import EngineConfig
from minipd.layers.moe import MoE
from minipd.models.decoder import DecoderModel


def set_moe_layers(model: DecoderModel, config: EngineConfig) -> list[MoE]:
    """Point every MoE layer of ``model`` at ``config.moe_backend`` (checked to run on the model's device), give
    them the config's capacity, routing-record and format settings; returns the layers."""
    device = model.embed_tokens.weight.device
    if config.moe_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("moe_backend='triton' needs a CUDA device, or TRITON_INTERPRET=1 set before triton is "
                         "imported to run it (slowly) on the CPU")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for module in layers:
        module.experts.implementation = config.moe_backend  # type: ignore[assignment]
        module.routing_log = [] if config.record_routing else None
        module.capacity_factor = config.moe_capacity_factor
        module.overflow = config.moe_overflow
        module.router.weight_format = None if config.router_dtype == "auto" else config.router_dtype
        module.dispatch_format = None if config.moe_dispatch_dtype == "auto" else config.moe_dispatch_dtype
    return layers


def set_weight_dtype(model: DecoderModel, weight_dtype: str) -> None:
    """Quantize the linears to int8 (``weight_dtype="int8"``); refuse float weights that are gone already."""
    from minipd.kernels.int8_linear import Int8Linear, quantize_linears

    if any(isinstance(m, Int8Linear) for m in model.modules()):
        if weight_dtype != "int8":  # its float weights are gone: say so rather than run int8 silently
            raise ValueError("this model's linears were quantized to int8 (weight_dtype='int8' by another "
                             "engine): pass weight_dtype='int8', or load the model again for float weights")
    elif weight_dtype == "int8":
        quantize_linears(model)


def set_linear_backend(model: DecoderModel, backend: str) -> tuple[str, str]:
    """Pack the linears as ``backend`` says ("torch", "onednn", "cpu", or "auto": the fastest measured on this
    machine; not measured, minipd's C++ kernel where it is built, else oneDNN where it packs); returns the
    backend and why it was chosen."""
    from minipd.kernels.cpu_linear import (
        PANEL_DTYPES,
        onednn_available,
        pack_linears,
        pack_panel_linears,
        panel_kernels,
        unpack_linears,
    )
    from minipd.kernels.measured import measured_record

    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    unpack_linears(model)  # (a model another engine packed: this engine's choice is its own)
    reason = "asked for"
    narrow_cpu = device.type == "cpu" and dtype in PANEL_DTYPES and dtype != torch.float32
    if backend == "auto" and narrow_cpu:
        # bf16/fp16 weights: nothing to measure between paths that do not all take them. Torch's product of a few
        # bf16 rows is several times slower than the panel kernel streaming them (which widens them to fp32).
        if panel_kernels() is not None:
            backend, reason = "cpu", (f"{str(dtype).removeprefix('torch.')} weights: minipd's C++ kernel, built "
                                      "(it streams them and multiplies in fp32)")
        else:
            backend, reason = "torch", (f"{str(dtype).removeprefix('torch.')} weights and minipd's C++ kernels are "
                                        "not built (python -m minipd build-kernels)")
    elif backend == "auto":
        fp32_cpu = device.type == "cpu" and dtype == torch.float32
        ready = {"cpu": fp32_cpu and panel_kernels() is not None, "onednn": fp32_cpu and onednn_available(),
                 "torch": True}
        record = measured_record("linear_backend") if fp32_cpu else None
        # A record from before the C++ kernel existed (or was built) did not time it: not a measurement of it.
        stale = record is not None and ready["cpu"] and "cpu" not in record.get("candidates", ())
        measured = None if record is None or stale else record.get("choice")
        if ready.get(measured):
            backend, reason = measured, "measured on this machine (build-kernels)"
        elif ready["cpu"]:
            backend, reason = "cpu", "not measured on this machine (python -m minipd build-kernels measures it): " \
                                     "minipd's C++ kernel, built"
        elif ready["onednn"]:
            backend, reason = "onednn", ("not measured on this machine (python -m minipd build-kernels measures it): "
                                         "oneDNN where it packs")
        else:
            backend, reason = "torch", ("packed linears take fp32, bf16 or fp16 weights on a CPU only" if not fp32_cpu
                                        else "neither minipd's C++ kernels nor oneDNN are here")
        if measured is not None and measured != backend:
            reason += f" (measured: {measured!r}, not available now)"
    if backend == "onednn" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"linear_backend='onednn' packs fp32 weights on the CPU; this model is "
                         f"{dtype} on {device.type}: use linear_backend='cpu' (fp32, bf16, fp16), 'torch' or 'auto'")
    if backend == "cpu" and (device.type != "cpu" or dtype not in PANEL_DTYPES):
        raise ValueError(f"linear_backend='cpu' packs fp32, bf16 or fp16 weights on the CPU; this model is "
                         f"{dtype} on {device.type}: use linear_backend='torch' or 'auto'")
    if backend in ("onednn", "cpu"):
        (pack_linears if backend == "onednn" else pack_panel_linears)(model)
    return backend, reason
