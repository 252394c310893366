"""Measure, on real engine steps of a bundled model, the choices :mod:`minipd.kernels.measured` keeps per machine.

Timed on whole steps, not on the linears alone: a bench of the linears chose the slower path on this
project's CPU, because a small step is dozens of small ops, each paying the threads' fork and join.
Engines of every configuration are built side by side and their runs interleaved, so a busy moment of a
shared machine hurts each of them alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from minipd.kernels.measured import MARGIN, TIE, best_seconds, cpu_description


def _step_times(core: Any, batch: int, prompt_len: int, rounds_tag: str) -> tuple[float, float]:
    """One run of ``batch`` requests of ``prompt_len`` tokens through ``core``: the first (prefill) step's time
    and the median of its decode steps."""
    from minipd.engine.request import Request
    from minipd.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 250 + 3 for j in range(prompt_len)]
        core.add_request(Request(f"{rounds_tag}{i}", ids, prompt_len, params, 0, frozenset(), 1024, 0.0))
    steps = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    return steps[0], statistics.median(steps[2:])


#: Decode steps counted per prefill step in a case's time: a typical answer's length. (With ten, a batch's prefill
#: outweighed its decodes and hid oneDNN's gain on 32-row decode steps, 0.65x F.linear's time on the AVX2 EPYC.)
DECODE_STEPS_PER_PREFILL = 64


def _measure_cores(options: dict[str, dict[str, Any]], cases: tuple[tuple[int, int], ...], rounds: int,
                   model: str, decode_steps: int = DECODE_STEPS_PER_PREFILL) -> dict[str, dict[tuple[int, int], float]]:
    """For each engine configuration in ``options``, each (batch, prompt length) case: the median over ``rounds``
    (interleaved across configurations) of its prefill step plus ``decode_steps`` times its median decode step."""
    from minipd.engine.config import EngineConfig
    from minipd.engine.factory import build_core

    before = torch.get_num_threads()
    built = {name: build_core(model, engine_config=EngineConfig(num_kv_blocks=512, enable_prefix_caching=False,
                                                                **opts)) for name, opts in options.items()}
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {c: [] for c in cases} for name in built}
    try:
        for r in range(rounds):
            for case in cases:
                for name, b in built.items():  # interleaved: a busy moment hurts every configuration
                    prefill, decode = _step_times(b.core, *case, f"r{r}-")
                    times[name][case].append(prefill + decode_steps * decode)
    finally:
        for b in built.values():
            b.close()
        torch.set_num_threads(before)
    return {name: {c: statistics.median(v) for c, v in per.items()} for name, per in times.items()}


#: (batch, prompt length) cases the linear paths are timed on: one stream, decode batches, a long prefill.
LINEAR_CASES = ((1, 32), (8, 32), (32, 64), (1, 512))


def measure_linear_backend(rounds: int = 3, model: str = "tiny-py",
                           cases: tuple[tuple[int, int], ...] = LINEAR_CASES) -> dict[str, Any]:
    """Time ``model``'s engine steps with each linear path there is here — ``F.linear``, oneDNN's packed
    weights, minipd's C++ panel kernel (fp32, this process's threads) — on (batch, prompt length) ``cases``:
    one stream, small and large decode batches, a long prefill. Each case counts its prefill step and
    :data:`DECODE_STEPS_PER_PREFILL` decode steps; the medians are summed.

    Returns the record: ``choice`` (the fastest packed path if it takes under :data:`MARGIN` of torch's time,
    else "torch"), ``candidates`` (the paths timed), ``ratios`` (each path's time over torch's) and the
    per-case ratios. (Measured on real steps: a bench of the linears alone chose wrong on this project's CPU.)"""
    from minipd.kernels.cpu_linear import onednn_available, panel_kernels

    candidates = ["torch"] + (["onednn"] if onednn_available() else []) + (["cpu"] if panel_kernels() else [])
    if len(candidates) == 1:
        return {"choice": "torch", "why": "neither oneDNN nor minipd's C++ kernels are here", "ratio": None,
                "candidates": candidates}
    threads = torch.get_num_threads()
    t = _measure_cores({name: {"linear_backend": name, "cpu_threads": threads} for name in candidates}, cases,
                       rounds, model)
    ratios = {name: round(sum(t[name].values()) / sum(t["torch"].values()), 3) for name in candidates}
    fastest = min(candidates[1:], key=ratios.__getitem__)
    return {"choice": fastest if ratios[fastest] < MARGIN else "torch", "ratio": ratios[fastest],
            "ratios": ratios, "candidates": candidates,
            "cases": {f"{b}x{n}": {name: round(t[name][(b, n)] / t["torch"][(b, n)], 3) for name in candidates[1:]}
                      for b, n in cases},
            **cpu_description()}


def measure_small_step_tokens(threads: int | None = None, rounds: int = 3, model: str = "tiny-py",
                              sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> dict[str, Any]:
    """Up to how many tokens a step is faster on one thread than on ``threads`` (torch's count by default),
    measured on real steps of ``model`` (a proxy of linears alone misleads: a small step is dozens of small
    ops, each paying the threads' fork and join): batches of each size on one thread and on all,
    interleaved. The choice is the largest batch up to which one thread was never slower by more than
    :data:`TIE` (0: it always was)."""
    threads = threads or torch.get_num_threads()
    cases = tuple((size, 4) for size in sizes)
    # Ten decode steps a case, as when the rule was set: its 4-token prompts leave decode steps with almost no
    # attention, which would make one thread look as good as all for a 32-row step of a real context.
    t = _measure_cores({str(count): {"cpu_threads": count, "linear_backend": "torch"} for count in {1, threads}},
                       cases, rounds, model, decode_steps=10)
    ratios = {size: round(t["1"][(size, 4)] / t[str(threads)][(size, 4)], 3) for size in sizes}
    choice = 0
    for size, ratio in ratios.items():  # (in increasing order)
        if ratio > TIE:
            break
        choice = size
    return {"choice": choice, "threads": threads, "one_thread_vs_all": ratios, **cpu_description()}


#: Row counts at which torch's product of bf16/fp16 weights is timed against the panel kernel, and the weights:
#: eight 2048 x 2048 matrices, 64 MiB in bf16, more than a last-level cache holds, as a model's linears are.
NARROW_ROWS = (8, 16, 32, 64, 128, 256)
NARROW_SHAPE = (2048, 2048)
NARROW_MATRICES = 8


def measure_narrow_matmul_rows(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
                               rounds: int = 3, rows: tuple[int, ...] = NARROW_ROWS) -> dict[str, Any]:
    """For each weight dtype: from how many rows another product takes under :data:`MARGIN` of the panel kernel's
    time, at that row count and every larger one timed; None where it never does. For bf16 and fp16 that is
    torch's own product (``F.linear``; oneDNN with the CPU's bf16 instructions where it has them), for fp32
    oneDNN's packed product (None where this torch has none). The two paths alone, over :data:`NARROW_MATRICES`
    weights that do not fit the caches (as a model's do not), on this process's threads, interleaved: the crossover
    is in batches of several register blocks, where a step is a few large products, not the dozens of small ops
    that made timing linears alone mislead for decode steps. (On the Zen 4 EPYC with AVX512-BF16: torch's bf16
    product took 0.86x the panels' time at 16 rows and 0.44–0.49x from 128; fp16's, without fp16 arithmetic,
    3.6–4.8x. On a Zen 5 EPYC, whose AVX-512 units are twice as wide: oneDNN's fp32 product 0.81x at 8 rows,
    0.52x from 256, about 490 GFLOP/s on two cores against the panels' 250 while their blocks were AVX2; with
    AVX-512 blocks, 1.31x at 8 rows, 1.00x at 32, 0.91x at 64, 0.79x at 256.)"""
    import torch.nn.functional as F

    from minipd.kernels.cpu_linear import onednn_available, onednn_multiply, onednn_pack, panel_kernels

    module = panel_kernels()
    if module is None:
        return {"choice": {}, "why": "minipd's C++ kernels are not built"}
    out_features, in_features = NARROW_SHAPE
    ratios: dict[str, dict[int, float]] = {}
    choice: dict[str, int | None] = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        fp32 = dtype == torch.float32
        if fp32 and not onednn_available():
            choice[name] = None
            continue
        weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(NARROW_MATRICES)]
        packed = [module.pack_panels(w) for w in weights]
        onednn = [onednn_pack(w) for w in weights] if fp32 else []
        ratios[name] = {}
        for count in rows:
            x = torch.randn(count, in_features).to(dtype)
            panel, plain = [], []
            def through_panels(x: torch.Tensor = x, packed: list = packed) -> None:
                for p in packed:
                    module.panel_linear(x, p, None, out_features)

            def through_torch(x: torch.Tensor = x, weights: list = weights, onednn: list = onednn) -> None:
                if onednn:  # fp32: oneDNN's packed product
                    for w in onednn:
                        onednn_multiply(x, w, None, out_features)
                else:
                    for w in weights:
                        F.linear(x, w)

            for _ in range(rounds):  # interleaved
                panel.append(best_seconds(through_panels, 1))
                plain.append(best_seconds(through_torch, 1))
            ratios[name][count] = round(statistics.median(plain) / statistics.median(panel), 3)
        faster = [count for count in rows if all(ratios[name][c] < MARGIN for c in rows if c >= count)]
        choice[name] = min(faster) if faster else None
    return {"choice": choice, "torch_vs_panels": ratios, "shape": list(NARROW_SHAPE), "matrices": NARROW_MATRICES,
            **cpu_description()}


__all__ = ["LINEAR_CASES", "NARROW_ROWS", "measure_linear_backend", "measure_narrow_matmul_rows",
           "measure_small_step_tokens"]
