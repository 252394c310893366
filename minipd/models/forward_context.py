"""What one forward pass needs besides its inputs: the KV cache for this step and the kernels to use.

It is passed to the model with every call rather than patched onto its modules, so one model can
serve several runners (a prefill worker and a decode worker in one process, two kernel backends
side by side) without one changing what the other runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipd.kernels.backend import TORCH_BACKEND, KernelBackend
from minipd.kv.base import KVCache


@dataclass(frozen=True)
class ForwardContext:
    """The cache (None for plain full attention) and the kernel backend of one forward pass."""

    cache: KVCache | None = None
    kernels: KernelBackend = TORCH_BACKEND

    @classmethod
    def of(cls, context: ForwardContext | KVCache | None) -> ForwardContext:
        """``context`` itself, or a context around a bare cache (or none) with the torch kernels."""
        return context if isinstance(context, ForwardContext) else cls(cache=context)
