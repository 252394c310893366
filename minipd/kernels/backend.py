"""One switch for the engine's kernels: ``"torch"`` (the references), ``"triton"`` (GPU) or ``"cpu"`` (C++ paged
attention, and one-pass RMSNorm, RoPE and SwiGLU activation for fp32 eager steps, built for this machine).

A backend also says which KV formats it can read (:meth:`KernelBackend.check`), so an engine
refuses a ``block_size`` or cache dtype its kernels cannot take when it is built, not at the first step.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minipd.kernels.activation import silu_and_mul
from minipd.kernels.kv_store import store_kv_torch
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from minipd.kernels.rms_norm import add_rms_norm_torch, rms_norm
from minipd.kernels.rotary import apply_rotary
from minipd.kv.spec import KVSpec

BACKENDS = ("torch", "triton", "cpu")


@dataclass(frozen=True)
class KernelBackend:
    """The kernels one backend provides, all with the torch references' signatures."""

    name: str
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    #: Returns why ``(spec, model_dtype)`` cannot run on this backend, or None when it can.
    limits: Callable[[KVSpec, torch.dtype], str | None] = lambda spec, dtype: None
    #: RMSNorm alone (a layer's input norm, the final norm, Qwen3's q/k norms).
    rms_norm: Callable[..., torch.Tensor] = rms_norm
    #: RoPE on (tokens, heads, head_dim) queries or keys.
    rotary: Callable[..., torch.Tensor] = apply_rotary
    #: SwiGLU's ``silu(gate) * up`` from the fused gate/up projection's output.
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul

    def check(self, spec: KVSpec, model_dtype: torch.dtype) -> None:
        """Raise ``ValueError`` naming the setting when this backend cannot run ``spec``."""
        problem = self.limits(spec, model_dtype)
        if problem is not None:
            raise ValueError(f"kernel_backend={self.name!r} {problem}")


def _torch_limits(spec: KVSpec, model_dtype: torch.dtype) -> str | None:
    return None  # the references read every format


def _triton_limits(spec: KVSpec, model_dtype: torch.dtype) -> str | None:
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if not pow2(spec.block_size):
        return f"needs a power-of-two block_size (8, 16, 32, ...), got {spec.block_size}"
    if spec.latent:
        return None  # multi-head latent attention runs its own torch attention over the latents on any backend
    if not pow2(spec.head_dim):
        return f"needs a power-of-two head_dim, and this model's is {spec.head_dim}; use kernel_backend='torch'"
    if spec.is_quantized:
        return None  # the kernels dequantize int8 and fp8 tiles as they load them
    if spec.dtype != model_dtype:
        return (f"reads the cache in the model's dtype ({model_dtype}); kv_cache_dtype gives {spec.dtype}: "
                "use kv_cache_dtype='auto' or kernel_backend='torch'")
    return None


TORCH_BACKEND = KernelBackend("torch", store_kv_torch, paged_decode_attention_torch,
                              paged_prefill_attention_torch, add_rms_norm_torch, _torch_limits)


def default_backend_name(device: torch.device) -> str:
    """Triton on CUDA (when installed); on a CPU the compiled C++ attention kernels once built; else torch."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if device.type == "cpu":
        from minipd.kernels.cpu_paged_attention import kernel_built

        return "cpu" if kernel_built() else "torch"
    return "torch"


def get_backend(name: str | None, device: torch.device) -> KernelBackend:
    """The backend called ``name`` (None picks the default for ``device``), checked to run there."""
    name = name or default_backend_name(device)
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        return _cpu_backend(device)
    if name != "triton":
        raise ValueError(f"kernel_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernel_backend='triton' needs a CUDA device, or TRITON_INTERPRET=1 set before "
                         "triton is imported to run it (slowly) on the CPU")
    try:
        from minipd.kernels.triton_kv_store import store_kv_triton
        from minipd.kernels.triton_paged_attention import (
            paged_decode_attention_triton,
            paged_prefill_attention_triton,
        )
        from minipd.kernels.triton_rms_norm import add_rms_norm_triton
    except ImportError as err:
        raise ValueError(f"kernel_backend='triton' is not available here: {err}") from err
    return KernelBackend("triton", store_kv_triton, paged_decode_attention_triton,
                         paged_prefill_attention_triton, add_rms_norm_triton, _triton_limits)


def _cpu_backend(device: torch.device) -> KernelBackend:
    """The torch references with the compiled C++ kernels in their place: paged decode and prefill attention,
    and (for fp32 activations in eager steps) RMSNorm, the residual add + RMSNorm, RoPE and SwiGLU's activation."""
    from minipd.kernels.cpu_norm_rope import add_rms_norm_cpu, apply_rotary_cpu, rms_norm_cpu, silu_mul_cpu
    from minipd.kernels.cpu_paged_attention import (
        load_kernel,
        paged_decode_attention_cpu,
        paged_prefill_attention_cpu,
    )

    if device.type != "cpu":
        raise ValueError(f"kernel_backend='cpu' runs on the CPU; this model is on {device.type}")
    module, why = load_kernel()
    if module is None:
        raise ValueError(f"kernel_backend='cpu' could not be built here ({why}); use kernel_backend='torch'")
    return KernelBackend("cpu", store_kv_torch, paged_decode_attention_cpu, paged_prefill_attention_cpu,
                         add_rms_norm_cpu, _torch_limits, rms_norm=rms_norm_cpu, rotary=apply_rotary_cpu,
                         silu_mul=silu_mul_cpu)


def kernel_backends() -> dict[str, str]:
    """Each kernel backend and whether it can run here, in words."""
    backends = {"torch": "available (scaled_dot_product_attention)"}
    if importlib.util.find_spec("triton") is None:
        backends["triton"] = "not installed"
    elif torch.cuda.is_available():
        backends["triton"] = "available (compiled for CUDA)"
    else:
        backends["triton"] = "installed; runs on CPU only under TRITON_INTERPRET=1"
    from minipd.kernels.cpu_paged_attention import kernel_built
    from minipd.kernels.isa import ISA_ENV, kernel_isa

    backends["cpu"] = ("built (C++ paged decode; the CPU default)" if kernel_built()
                       else "not built yet: `python -m minipd build-kernels` (a C++ compiler and ninja)")
    isa = kernel_isa()
    if isa != "native":
        backends["cpu"] += f"; for {isa} ({ISA_ENV}), not all this CPU has"
    return backends
