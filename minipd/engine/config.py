"""The engine's knobs, checked once, in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineConfig:
    """How the engine sizes its KV pool and schedules work.

    Args:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool; when None, sized from ``kv_cache_memory``.
        kv_cache_memory: bytes for K and V; when None, 256 MiB on CPU or half the free GPU memory,
            and never more than ``max_num_seqs`` full-length sequences need.
        max_num_batched_tokens: token budget of one step, shared by decodes and prefill chunks.
        max_num_seqs: most requests running at once.
        enable_prefix_caching: reuse the KV blocks of prompts' common prefixes.
        scheduling_policy: ``"decode-first"`` (``"fcfs"``) or ``"prefill-first"``, or a policy object.
        kernel_backend: ``"torch"`` or ``"triton"``; None picks Triton on CUDA and torch on CPU.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    scheduling_policy: object = "decode-first"
    kernel_backend: str | None = None

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer or None, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int)
                                                 or self.kv_cache_memory < 1):
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes or None, got {self.kv_cache_memory!r}")

    @classmethod
    def from_options(cls, options: dict) -> EngineConfig:
        """Build from ``LLM(**options)``; an unknown option is an error that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**options)
