"""Time each engine kernel, Triton against its torch reference, and one decode step of a real-size model.

For every kernel it reports the median time, the bytes the operation has to move (each input
read once, each output written once, whichever backend runs it) over that time as GB/s, and that
as a fraction of the GPU's peak HBM bandwidth. Decode attention, the KV store and the norm are
memory-bound, so that fraction is their score; prefill attention is compute-bound, so it also
gets TFLOP/s. Then a decode step of a Qwen3-0.6B-shaped model with random weights runs through
the engine's paged path with each backend, at batch 1 and 64.

    python scripts/gpu_bench.py                 # on a CUDA machine; writes $OUT/gpu_report.md if $OUT is set
    python scripts/gpu_bench.py --dry-run       # anywhere: tiny shapes, torch backend, CPU (checks the logic)
    python scripts/gpu_bench.py --dry-run --interpret   # the same plus the Triton kernels in the interpreter

Run from the repository root with ``PYTHONPATH=.`` (``scripts/gpu_check.sh`` does both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # minipd from this checkout, even without PYTHONPATH

from minipd.config import ModelConfig, RopeConfig
from minipd.kernels.backend import KernelBackend

#: H200 SXM datasheet HBM3e bandwidth, bytes per second.
PEAK_BYTES_PER_S = 4.8e12
#: H200 SXM datasheet dense bf16 tensor-core throughput, FLOP per second.
PEAK_FLOPS = 989e12
#: Bytes written over the L2 cache before each timed run, so no kernel is timed out of a warm cache.
L2_FLUSH_BYTES = 256 * 2**20


@dataclass
class Row:
    """One timed measurement: a kernel on one shape with one backend."""

    kernel: str
    shape: str
    backend: str
    ms: float
    bytes_moved: int
    flops: int = 0
    note: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / (self.ms * 1e-3) / 1e9

    @property
    def peak_fraction(self) -> float:
        return self.bytes_moved / (self.ms * 1e-3) / PEAK_BYTES_PER_S


def torch_kernels() -> KernelBackend:
    from minipd.kernels.backend import TORCH_BACKEND

    return TORCH_BACKEND


def triton_kernels() -> KernelBackend:
    # Imported only here, so a --dry-run never needs triton.
    from minipd.kernels.backend import get_backend

    return get_backend("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))


class Timer:
    """Median wall time of a function: CUDA events on the GPU (L2 flushed before each run), perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int) -> None:
        self.device, self.warmup, self.reps = device, warmup, reps
        on_gpu = device.type == "cuda"
        self.flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if on_gpu else None

    def __call__(self, fn: Callable[[], object]) -> float:
        """Milliseconds, median over ``reps`` runs after ``warmup`` untimed ones (which also compile)."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.flush is not None:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def add(rows: list[Row], row: Row) -> None:
    """Append ``row`` and print it at once, so a run cut short still shows what it measured."""
    rows.append(row)
    print(f"  {row.kernel:18} {row.shape:26} {row.backend:7} {row.ms:9.4f} ms {row.gb_per_s:9,.0f} GB/s", flush=True)


# --- inputs --------------------------------------------------------------------------------------


def paged_pool(lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V pool with sequences of ``lens`` tokens in shuffled blocks; (k, v, block_tables, context_lens)."""
    counts = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(counts), device=device).to(torch.int32)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(counts):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (sum(counts), block_size, kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Shapes:
    """The attention shapes of one layer of the benchmarked model, and the sizes to sweep."""

    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    block_size: int
    store_tokens: tuple[int, ...]
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    prefill: tuple[tuple[int, int, int], ...]  # (batch, new tokens, context)
    norm_tokens: tuple[int, ...]


# Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, hidden 1024.
FULL = Shapes(16, 8, 128, 1024, 16, store_tokens=(64, 8192), decode=((1, 4096), (64, 1024), (64, 4096)),
              prefill=((4, 1024, 1024), (1, 512, 4096)), norm_tokens=(64, 8192))
TINY = Shapes(4, 2, 32, 64, 16, store_tokens=(4, 64), decode=((1, 40), (4, 33)), prefill=((2, 20, 20), (1, 8, 40)),
              norm_tokens=(4, 64))


# --- kernel benchmarks ---------------------------------------------------------------------------


def bench_kernels(backends: list[KernelBackend], shapes: Shapes, dtype: torch.dtype, device: torch.device,
                  timer: Timer) -> list[Row]:
    """Every kernel on every size in ``shapes`` with every backend."""
    e = torch.empty((), dtype=dtype).element_size()
    hq, hkv, d, bs = shapes.q_heads, shapes.kv_heads, shapes.head_dim, shapes.block_size
    rows: list[Row] = []

    for n in shapes.store_tokens:
        k_cache, v_cache, _, _ = paged_pool([n + bs], hkv, d, bs, dtype, device)
        k = torch.randn(n, hkv, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        slots = torch.randperm(k_cache.shape[0] * bs, device=device)[:n]
        moved = 4 * n * hkv * d * e + n * 8  # read k, v; write them into the pool; read the slots
        for kern in backends:
            ms = timer(partial(kern.store_kv, k, v, k_cache, v_cache, slots))
            add(rows, Row("store_kv", f"{n} tokens", kern.name, ms, moved))

    for batch, context in shapes.decode:
        lens = [context] * batch
        k_cache, v_cache, tables, ctx = paged_pool(lens, hkv, d, bs, dtype, device)
        q = torch.randn(batch, hq, d, dtype=dtype, device=device)
        moved = 2 * sum(lens) * hkv * d * e + 2 * batch * hq * d * e + tables.numel() * 4 + batch * 4
        for kern in backends:
            ms = timer(partial(kern.paged_decode_attention, q, k_cache, v_cache, tables, ctx, d**-0.5))
            add(rows, Row("decode_attention", f"B={batch} ctx={context}", kern.name, ms, moved))

    for batch, new, context in shapes.prefill:
        lens = [context] * batch
        k_cache, v_cache, tables, ctx = paged_pool(lens, hkv, d, bs, dtype, device)
        starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
        q = torch.randn(batch * new, hq, d, dtype=dtype, device=device)
        moved = 2 * sum(lens) * hkv * d * e + 2 * q.numel() * e
        # Query i of a chunk sees context - new + i + 1 keys; two matmuls of 2 FLOPs per multiply-add.
        pairs = batch * sum(context - new + i + 1 for i in range(new))
        flops = 4 * pairs * hq * d
        for kern in backends:
            ms = timer(partial(kern.paged_prefill_attention, q, k_cache, v_cache, tables, starts, ctx, d**-0.5))
            add(rows, Row("prefill_attention", f"B={batch} new={new} ctx={context}", kern.name, ms, moved, flops))

    for tokens in shapes.norm_tokens:
        x = torch.randn(tokens, shapes.hidden, dtype=dtype, device=device)
        res = torch.randn_like(x)
        w = torch.randn(shapes.hidden, dtype=dtype, device=device)
        moved = 4 * x.numel() * e + w.numel() * e
        for kern in backends:
            ms = timer(partial(kern.add_rms_norm, x, res, w, 1e-6))
            add(rows, Row("add_rms_norm", f"{tokens}x{shapes.hidden}", kern.name, ms, moved))
    return rows


def check_agreement(backends: list[KernelBackend], shapes: Shapes, dtype: torch.dtype,
                    device: torch.device) -> list[str]:
    """Max |triton - torch| of decode and prefill attention on one mid-size input, as a sanity line."""
    if len(backends) < 2:
        return []
    ref, other = backends[0], backends[1]
    hq, hkv, d, bs = shapes.q_heads, shapes.kv_heads, shapes.head_dim, shapes.block_size
    lens = [1, 17, 300, 1000]
    k_cache, v_cache, tables, ctx = paged_pool(lens, hkv, d, bs, dtype, device)
    q = torch.randn(len(lens), hq, d, dtype=dtype, device=device)
    diff_d = (other.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5).float()
              - ref.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5).float()).abs().max().item()
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    qp = torch.randn(sum(lens), hq, d, dtype=dtype, device=device)
    prefill_args = (qp, k_cache, v_cache, tables, starts, ctx, d**-0.5)
    diff_p = (other.paged_prefill_attention(*prefill_args).float()
              - ref.paged_prefill_attention(*prefill_args).float()).abs().max().item()
    return [f"{other.name} vs {ref.name}, lengths {lens}, {dtype}: decode max |diff| {diff_d:.2e}, "
            f"prefill max |diff| {diff_p:.2e}"]


# --- a decode step of a real-size model ----------------------------------------------------------


def qwen3_06b_config(tiny: bool) -> ModelConfig:
    """Qwen3-0.6B's shape (bf16, tied embeddings), or a tiny one of the same family for dry runs."""
    if tiny:
        return ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
                           sliding_windows=(None, None))
    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                       tie_word_embeddings=True, qk_norm=True, sliding_windows=(None,) * 28)


@torch.inference_mode()
def decode_step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: object) -> torch.Tensor:
    """The model's forward over one token per sequence, then the LM head: what one engine step computes."""
    return model.compute_logits(model(ids, positions, cache))


def bench_model_step(backend_names: list[str], tiny: bool, dtype: torch.dtype, device: torch.device,
                     timer: Timer) -> tuple[list[Row], list[str]]:
    """One decode step (every sequence adds one token) through ``minipd``'s paged engine path.

    The model is built directly with random weights; the pool is filled with random K/V standing in
    for earlier prefill. Bytes counted: every weight once (the tied embedding is read in full by
    the LM head) plus the K/V each sequence's attention reads.
    """
    from minipd.kernels.backend import get_backend
    from minipd.kv.paged_cache import PagedAttentionMetadata, PagedKVCache
    from minipd.kv.paged_pool import PagedKVPool
    from minipd.kv.spec import KVSpec
    from minipd.models.decoder import DecoderModel
    from minipd.models.forward_context import ForwardContext

    config = qwen3_06b_config(tiny)
    with torch.device(device):
        model = DecoderModel(config)
    model = model.to(dtype).eval().requires_grad_(False)
    model.rotary.reset_cache(device)  # .to(dtype) rounded the cos/sin tables; rebuild them in fp32
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    e = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * e
    block_size = 16
    context = 64 if tiny else 1024
    rows: list[Row] = []
    notes: list[str] = []
    for batch in (1, 4) if tiny else (1, 64):
        per_seq = -(-context // block_size)
        pool = PagedKVPool(KVSpec.for_model(config, block_size, dtype), batch * per_seq, device)
        pool.k.normal_()
        pool.v.normal_()
        tables = torch.randperm(batch * per_seq, device=device).to(torch.int32).view(batch, per_seq)
        pos = context - 1  # the new token is the last of `context`
        slots = tables[:, pos // block_size].long() * block_size + pos % block_size
        empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        metadata = PagedAttentionMetadata(
            num_decode_tokens=batch, slot_mapping=slots, decode_block_tables=tables,
            decode_context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            prefill_block_tables=empty_i32.view(0, 0), prefill_query_start_loc=torch.zeros(1, dtype=torch.int32,
                                                                                           device=device),
            prefill_context_lens=empty_i32, decode_context_lens_host=[context] * batch,
            prefill_query_start_host=[0], prefill_context_lens_host=[])
        ids = torch.randint(0, config.vocab_size, (batch,), device=device)
        positions = torch.full((batch,), pos, dtype=torch.long, device=device)
        kv_bytes = config.kv_bytes_per_token(e) * batch * context
        logits: dict[str, torch.Tensor] = {}
        for name in backend_names:
            kernels = get_backend(name, device)
            cache = ForwardContext(PagedKVCache(pool, metadata, kernels), kernels)

            step = partial(decode_step, model, ids, positions, cache)
            logits[name] = step()
            ms = timer(step)
            add(rows, Row("model decode step", f"B={batch} ctx={context}", name, ms, weight_bytes + kv_bytes,
                          note=f"{batch / (ms * 1e-3):,.0f} tok/s"))
        if len(logits) == 2:
            a, b = logits.values()
            agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
            notes.append(f"model step B={batch}: logits max |diff| between backends "
                         f"{(a - b).abs().max().item():.2e}, same argmax for {agree:.0%} of rows")
    return rows, notes


# --- report --------------------------------------------------------------------------------------


def render(rows: list[Row], notes: list[str], header: list[str]) -> str:
    """A markdown report: the context lines, one table, and the notes."""
    lines = [*header, "", "| kernel | shape | backend | median ms | GB/s | % of peak HBM | TFLOP/s | speed-up | note |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    baseline = {(r.kernel, r.shape): r.ms for r in rows if r.backend == "torch"}
    for r in rows:
        base = baseline.get((r.kernel, r.shape))
        speedup = f"{base / r.ms:.2f}x" if base and r.backend != "torch" else ""
        tflops = f"{r.flops / (r.ms * 1e-3) / 1e12:.1f}" if r.flops else ""
        lines.append(f"| {r.kernel} | {r.shape} | {r.backend} | {r.ms:.4f} | {r.gb_per_s:,.0f} | "
                     f"{100 * r.peak_fraction:.1f} | {tflops} | {speedup} | {r.note} |")
    lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, torch backend only, on CPU")
    parser.add_argument("--interpret", action="store_true",
                        help="with --dry-run: also run the Triton kernels, in the interpreter (slow)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 10; 1 dry)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs, median reported (default 50; 3 dry)")
    parser.add_argument("--out", type=Path, default=None, help="report path (default $OUT/gpu_report.md if $OUT)")
    parser.add_argument("--skip-model", action="store_true", help="kernels only, no model decode step")
    args = parser.parse_args(argv)

    if args.dry_run:
        device, dtype, shapes = torch.device("cpu"), torch.float32, TINY
        backends, names = [torch_kernels()], ["torch"]
        if args.interpret:
            os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import, in triton_kernels()
            backends.append(triton_kernels())
            names.append("triton")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to exercise the script on CPU", file=sys.stderr)
            return 2
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, FULL
        backends, names = [torch_kernels(), triton_kernels()], ["torch", "triton"]
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 10)
    reps = args.reps if args.reps is not None else (3 if args.dry_run else 50)
    timer = Timer(device, warmup, reps)
    torch.manual_seed(0)

    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    header = [f"# minipd kernel benchmark{' (dry run: tiny shapes, not meaningful numbers)' if args.dry_run else ''}",
              "", f"- device: {gpu}; torch {torch.__version__}; dtype {dtype}; median of {reps} runs after {warmup} "
              f"warm-up; L2 flushed before each GPU run",
              f"- GB/s = bytes the operation must move (inputs read once, outputs written once) / time; "
              f"peak = H200 datasheet {PEAK_BYTES_PER_S / 1e12:.1f} TB/s HBM, "
              f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16 dense",
              f"- layer shapes{'' if args.dry_run else ' of Qwen3-0.6B'}: {shapes.q_heads} q heads, "
              f"{shapes.kv_heads} kv heads, head_dim {shapes.head_dim}, hidden {shapes.hidden}, "
              f"block_size {shapes.block_size}"]
    try:
        import triton

        header.append(f"- triton {triton.__version__}")
    except ImportError:
        pass
    print("\n".join(header), flush=True)

    rows = bench_kernels(backends, shapes, dtype, device, timer)
    notes = check_agreement(backends, shapes, dtype, device)
    if args.skip_model:
        notes.append("model decode step: not run: --skip-model")
    else:
        # Needs the engine's paged path (minipd.kv.paged_cache and friends); report rather than crash without it.
        try:
            model_rows, model_notes = bench_model_step(names, args.dry_run, dtype, device, timer)
            rows += model_rows
            notes += model_notes
        except Exception as err:
            notes.append(f"model decode step: not run: {type(err).__name__}: {err}")
    report = render(rows, notes, header)
    print(report[report.index("| kernel"):])
    out = args.out or (Path(os.environ["OUT"]) / "gpu_report.md" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        print(f"report written to {out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
