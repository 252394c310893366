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
    # None means the torch references. (Not TORCH_BACKEND as the default itself: torch 2.11's compiler
    # cannot wrap an object held in a function's defaults, and this __init__ runs inside compiled steps.)
    kernels: KernelBackend = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.kernels is None:
            object.__setattr__(self, "kernels", TORCH_BACKEND)

    @classmethod
    def of(cls, context: ForwardContext | KVCache | None) -> ForwardContext:
        """``context`` itself, or a context around a bare cache (or none) with the torch kernels."""
        return context if isinstance(context, ForwardContext) else cls(cache=context)
