"""Expert parallelism measured: ``python -m minipd bench --workload ep``.

One ``LLM(model, expert_parallel_size=N)`` serves the same greedy batch over and over, its rank 0
switching between two modes on the fly (the header tells the other ranks): **serial** (each all-to-all
waited for as soon as it starts) and **overlapped** (two micro-batches: one's rows travel while the
other's experts compute). A one-process ``LLM`` runs the batch in the same rounds as the baseline.
The variants are interleaved and repeated; min and median are reported. The fraction of
communication hidden is ``1 - wait(overlapped) / wait(serial)``, from the time rank 0 sat blocked on
the network.

Then the wire: the same batch with the dispatched rows as fp32, int8 or fp8 codes (a 2-byte scale per
row), bytes per dispatched row each way and greedy agreement with the uncompressed run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from minipd.llm import LLM
from minipd.sampling_params import SamplingParams

#: Prompts of the measured batch (Python, what the bundled models know).
PROMPTS = ("def fibonacci(n):", "import numpy as np\n\nclass Matrix:", "for i in range(10):\n    print(",
           "with open(path) as f:", "def parse_args():\n    parser = argparse.", "class Stack:\n    def push(self,",
           "try:\n    import torch\nexcept", "def quicksort(items):")


@dataclass
class Round:
    """One timed run of the batch."""

    seconds: float
    #: Seconds rank 0 was blocked on dispatch/combine (0 for one process).
    wait_seconds: float
    tokens: int


def run_batch(llm: LLM, params: SamplingParams, overlap: bool | None = None) -> Round:
    """Generate the batch once; ``overlap`` sets the expert-parallel mode first (None: leave it)."""
    ranks = llm.expert_parallel
    if ranks is not None:
        if overlap is not None:
            ranks.group.overlap = overlap
        ranks.stats.reset()
    start = time.perf_counter()
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    wait = ranks.stats.wait_seconds if ranks is not None else 0.0
    return Round(seconds, wait, sum(len(o.token_ids) for o in outputs))


def measure_overlap(single: LLM, parallel: LLM, max_tokens: int = 16, rounds: int = 3) -> dict[str, list[Round]]:
    """Interleaved rounds of the one-process, serial and overlapped variants (after one warm-up each)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    variants = {"one process": lambda: run_batch(single, params),
                "EP serial": lambda: run_batch(parallel, params, overlap=False),
                "EP overlapped": lambda: run_batch(parallel, params, overlap=True)}
    for run in variants.values():
        run()
    results: dict[str, list[Round]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            results[name].append(run())
    parallel.expert_parallel.group.overlap = True
    return results


def hidden_fraction(results: dict[str, list[Round]]) -> float:
    """Share of the serial mode's network wait that the overlapped mode no longer waits (medians)."""
    serial = statistics.median(r.wait_seconds for r in results["EP serial"])
    overlapped = statistics.median(r.wait_seconds for r in results["EP overlapped"])
    return 1 - overlapped / serial if serial > 0 else 0.0


def wire_table(parallel: LLM, max_tokens: int = 16) -> list[dict[str, float | str]]:
    """Per wire format of the dispatched rows: bytes per row and in all each way, greedy agreement."""
    from minipd.engine.expert_ranks import moe_layers_of

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    layers = moe_layers_of(parallel.model)
    stats = parallel.expert_parallel.stats
    rows: list[dict[str, float | str]] = []
    reference: list[list[int]] | None = None
    for wire in (None, "int8", "fp8"):
        for layer in layers:
            layer.dispatch_format = wire
        stats.reset()
        outputs = parallel.generate(list(PROMPTS), params, use_tqdm=False)
        tokens = [o.token_ids for o in outputs]
        reference = reference or tokens
        same = sum(a == b for ref, got in zip(reference, tokens, strict=True) for a, b in zip(ref, got, strict=True))
        total = sum(len(t) for t in reference)
        sent = max(stats.rows_sent, 1)
        rows.append({"wire": wire or str(parallel.dtype).removeprefix("torch."),
                     "dispatch B/row": stats.dispatch_sent / sent, "combine B/row": stats.combine_received / sent,
                     "dispatch KiB": stats.dispatch_sent / 1024, "combine KiB": stats.combine_received / 1024,
                     "greedy agreement": same / total})
    for layer in layers:
        layer.dispatch_format = None
    return rows


def main(model: str = "tiny-py-moe", scale: float = 1.0, size: int = 2) -> int:
    """Print the overlap measurement and the wire table."""
    max_tokens = max(4, round(16 * scale))
    threads = torch.get_num_threads()
    print(f"[ep] {model}, expert_parallel_size={size}, {len(PROMPTS)} prompts x {max_tokens} greedy tokens, "
          f"{threads} threads per process; min (median) of 3 interleaved rounds")
    single = LLM(model, moe_backend="loop")
    with LLM(model, moe_backend="loop", expert_parallel_size=size) as parallel:
        results = measure_overlap(single, parallel, max_tokens)
        base = statistics.median(r.seconds for r in results["one process"])
        print(f"  {'variant':14} {'tokens/s':>10} {'median':>10} {'net wait ms':>12} {'vs one process':>15}")
        for name, runs in results.items():
            best = min(runs, key=lambda r: r.seconds)
            median = statistics.median(r.seconds for r in runs)
            wait = statistics.median(r.wait_seconds for r in runs)
            print(f"  {name:14} {best.tokens / best.seconds:10.0f} {best.tokens / median:10.0f} "
                  f"{wait * 1e3:12.1f} {base / median:14.2f}x")
        print(f"  communication hidden by two overlapped micro-batches: {hidden_fraction(results):.0%} "
              "(of the serial mode's network wait)")
        print(f"  {'wire':9} {'dispatch B/row':>15} {'combine B/row':>14} {'dispatch KiB':>13} {'combine KiB':>12} "
              f"{'greedy agree':>13}")
        for row in wire_table(parallel, max_tokens):
            print(f"  {row['wire']:9} {row['dispatch B/row']:15.0f} {row['combine B/row']:14.0f} "
                  f"{row['dispatch KiB']:13.1f} {row['combine KiB']:12.1f} {row['greedy agreement']:13.1%}")
    return 0
