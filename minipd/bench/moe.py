"""The MoE kernel ladder timed: ``python -m minipd bench --workload moe``.

One MoE layer, three ways to run its experts (``moe_backend``): the per-expert loop (the reference),
rows sorted by expert through ``torch._grouped_mm``, and the fused Triton kernel (GPU only: on a CPU
the Triton interpreter checks correctness, not speed). Two shapes: layer 0 of the bundled
``tiny-py-moe`` (8 experts, top-2) and a larger random layer (64 experts, top-8, like the fine-grained
experts of Qwen3-MoE and DeepSeek-V3, scaled down), each at a decode-sized batch (a few tokens: few
rows per expert, so every expert's weights are read for almost no work) and a prefill-sized one.
The variants are interleaved and repeated; min and median are reported, with the ratio to the loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

#: (name, hidden, expert width, experts, top_k) of the random layer.
LARGE = ("random 64 experts, top-8", 256, 128, 64, 8)


def _layers(model: str) -> list[tuple[str, torch.nn.Module]]:
    from minipd.layers.moe import MoE
    from minipd.models import load_model

    # On a GPU the layers run there (the fused kernel needs CUDA tensors), in fp32 like on the CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours, _ = load_model(model, device=device, dtype=torch.float32)
    bundled = next(m for m in ours.modules() if isinstance(m, MoE))
    torch.manual_seed(0)
    name, hidden, inter, experts, top_k = LARGE
    return [(f"{model} layer 0 ({bundled.router.num_experts} experts, top-{bundled.top_k})", bundled),
            (name, MoE(hidden, inter, experts, top_k).to(device).eval())]


def backends() -> list[str]:
    """The paths that run fast here: the fused kernel only on a GPU."""
    from minipd.moe.experts import grouped_mm_supported

    paths = ["loop"]
    if grouped_mm_supported(torch.device("cpu"), torch.float32, 16) or torch.cuda.is_available():
        paths.append("grouped_mm")
    if torch.cuda.is_available():
        paths.append("triton")
    return paths


def time_layer(layer: torch.nn.Module, tokens: int, paths: Sequence[str], rounds: int = 5,
               repeat: int = 3) -> dict[str, list[float]]:
    """Seconds per forward of ``layer`` on ``tokens`` random rows, for each path, ``rounds`` interleaved times."""
    weight = layer.router.weight
    hidden = torch.randn(tokens, weight.shape[1], generator=torch.Generator().manual_seed(tokens)).to(weight.device)
    sync = torch.cuda.synchronize if weight.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {p: [] for p in paths}

    def run(path: str) -> Callable[[], torch.Tensor]:
        layer.experts.implementation = path
        return lambda: layer(hidden)

    with torch.inference_mode():
        for path in paths:  # warm-up
            run(path)()
        for _ in range(rounds):
            for path in paths:
                forward = run(path)
                sync()
                start = time.perf_counter()
                for _ in range(repeat):
                    forward()
                sync()
                times[path].append((time.perf_counter() - start) / repeat)
    layer.experts.implementation = "auto"
    return times


def main(model: str = "tiny-py-moe", scale: float = 1.0) -> int:
    """Print tokens/s per path, shape and batch, with the ratio to the loop."""
    paths = backends()
    batches = (4, max(16, round(512 * scale)))
    print(f"[moe] one MoE layer, {torch.get_num_threads()} threads; tokens/s from the min (median) of 5 "
          "interleaved rounds")
    if "triton" not in paths:
        print("  triton (fused kernel): not run, it needs a CUDA GPU; tests check it against the reference "
              "under the interpreter")
    print(f"  {'layer':44} {'tokens':>6} {'path':>11} {'tokens/s':>12} {'median':>12} {'vs loop':>8}")
    for name, layer in _layers(model):
        for tokens in batches:
            times = time_layer(layer, tokens, paths)
            base = min(times["loop"])
            for path in paths:
                best, median = min(times[path]), statistics.median(times[path])
                print(f"  {name:44} {tokens:6d} {path:>11} {tokens / best:12.0f} {tokens / median:12.0f} "
                      f"{base / best:7.2f}x")
    return 0
