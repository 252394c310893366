"""The floor a benchmark is measured against: this machine's matmul peak and memory bandwidth, measured
in the same run, and the useful FLOPs a workload needs.

"Useful" FLOPs are the model's: every weight a token is multiplied by, attention over the keys it
sees, and the LM head once per sampled token (:func:`minipd.sim.costs.step_cost`), nothing for padding or
recomputation. A run's achieved useful FLOP/s divided by the GEMM peak says how much of the machine
the engine turns into model arithmetic; the rest is overhead, memory stalls or small, inefficient
matrix products.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minipd.config import ModelConfig
from minipd.engine.stats import StepStats
from minipd.kernels.measured import best_seconds
from minipd.sim.costs import step_cost


@dataclass
class Floor:
    """Measured peaks of this machine (the best of a few interleaved repetitions)."""

    #: fp32 matmul FLOP/s, per path (``torch.mm``; ``onednn`` packed weights when the build has them; ``minipd``,
    #: the C++ panel kernel of ``linear_backend="cpu"``, when it is built: the peak is the fastest of them).
    fp32_flops: dict[str, float]
    #: bf16 matmul FLOP/s through ``torch.mm`` (0 when the CPU has no bf16 matmul worth the name).
    bf16_flops: float
    #: Bytes per second of a large copy (bytes read plus bytes written).
    bandwidth: float
    threads: int

    @property
    def fp32_peak(self) -> float:
        """The fastest fp32 matmul path's FLOP/s."""
        return max(self.fp32_flops.values())

    def best_with(self, other: Floor) -> Floor:
        """Each peak the higher of two measurements: a busy moment of a shared machine during one of them
        must not lower the bar that shares of the peak are measured against."""
        paths = {name: max(value, other.fp32_flops.get(name, 0.0)) for name, value in self.fp32_flops.items()}
        return Floor(paths, max(self.bf16_flops, other.bf16_flops), max(self.bandwidth, other.bandwidth), self.threads)


def measure_floor(size: int = 1024, copy_bytes: int = 256 * 2**20, repeat: int = 5) -> Floor:
    """Time ``size``³ matmuls (fp32 through torch, oneDNN and minipd's panel kernel where they exist; bf16) and a
    ``copy_bytes`` copy on this CPU."""
    from minipd.kernels.cpu_linear import onednn_available, panel_kernels

    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = 2 * size**3
    paths = {"torch.mm": lambda: torch.mm(a, b)}
    if onednn_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        paths["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    module = panel_kernels()
    if module is not None:  # the engine's own kernel counts too: a share of the peak must not pass 100%
        panels = module.pack_panels(b.t().contiguous())
        paths["minipd"] = lambda: module.panel_linear(a, panels, None, size)
    fp32 = {name: flops / best_seconds(fn, repeat) for name, fn in paths.items()}
    a16, b16 = a.bfloat16(), b.bfloat16()
    bf16 = flops / best_seconds(lambda: torch.mm(a16, b16), repeat)
    src = torch.empty(copy_bytes // 4)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / best_seconds(lambda: dst.copy_(src), repeat)
    return Floor(fp32, bf16, bandwidth, torch.get_num_threads())


def request_flops(config: ModelConfig, prompt_len: int, output_len: int) -> int:
    """Useful FLOPs of one request: its prefill (with the first token) and ``output_len - 1`` decode steps."""
    total = step_cost(config, [(0, prompt_len)]).flops
    # One decode step per further token, at a context one longer each time (sliding windows included).
    return total + sum(step_cost(config, [(prompt_len + i, 1)]).flops for i in range(output_len - 1))


def workload_flops(config: ModelConfig, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Useful FLOPs of a whole workload (see :func:`request_flops`)."""
    return sum(request_flops(config, p, n) for p, n in zip(prompt_lens, output_lens, strict=True))


def schedule_roofline(config: ModelConfig, steps: Sequence[StepStats], floor: Floor, dtype_bytes: int = 4) -> float:
    """The least time this machine could take for the steps an engine ran: each step at its roofline, its FLOPs
    at the fp32 GEMM peak or its weights and K/V moved at the copy bandwidth, whichever takes longer.

    It keeps the engine's own schedule (how many steps, what each carried), so it bounds that schedule, not
    every schedule; a decode row's context is its step's mean (the steps record the total, not each row's).
    """
    total = 0.0
    for step in steps:
        chunks = [(context - size, size) for size, context in zip(step.prefill_chunk_sizes,
                                                                  step.prefill_chunk_contexts, strict=True)]
        rows = step.num_decode_tokens
        if rows:
            context = max(1, (step.num_context_tokens - sum(step.prefill_chunk_contexts)) // rows)
            chunks += [(context - 1, 1)] * rows
        if not chunks:
            continue
        cost = step_cost(config, chunks, dtype_bytes=dtype_bytes)
        moved = cost.weight_bytes + cost.kv_read_bytes + cost.kv_write_bytes
        total += max(cost.flops / floor.fp32_peak, moved / floor.bandwidth)
    return total


def describe(floor: Floor) -> str:
    """One line for a benchmark's header."""
    paths = ", ".join(f"{name} {value / 1e9:.0f}" for name, value in floor.fp32_flops.items())
    return (f"this machine, {floor.threads} threads: fp32 GEMM {paths} GFLOP/s; bf16 GEMM {floor.bf16_flops / 1e9:.0f} "
            f"GFLOP/s; copy bandwidth {floor.bandwidth / 1e9:.1f} GB/s")


__all__ = ["Floor", "describe", "measure_floor", "request_flops", "schedule_roofline", "workload_flops"]
