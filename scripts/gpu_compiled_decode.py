"""Decode step time of minipd's engine on a GPU, eager against ``compile_decode`` (CUDA graphs), on a real-size
model shape with random weights (Llama-3-8B in bf16 by default), beside the roofline's floor (one read of the
weights and of the batch's K/V at the device's HBM bandwidth).

Each batch size runs its own requests (random prompts of ``--prompt-len`` tokens, ``--decode-steps`` tokens
each, EOS ignored); only steps in which every request decodes are timed. The variants alternate per batch size
(eager, compiled, eager, compiled, ...) so a drifting clock or a warm cache favours neither; min and median of
the step times are reported.

    python scripts/gpu_compiled_decode.py --out $OUT/compiled_decode.md      # on a CUDA machine
    python scripts/gpu_compiled_decode.py --dry-run                          # anywhere: a tiny model on CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # minipd from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sim_calibration import random_model

from minipd.config import ModelConfig
from minipd.engine.config import EngineConfig
from minipd.engine.core import EngineCore
from minipd.engine.request import Request
from minipd.sampling_params import SamplingParams
from minipd.sim.costs import preset


def decode_step_times(core: EngineCore, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> list[float]:
    """Seconds of each step in which all ``batch`` requests decode (prefill steps are not kept)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        core.add_request(Request(request_id=f"b{batch}-{seed}-{i}", all_token_ids=ids, num_prompt_tokens=prompt_len,
                                 params=params, seed=0, eos_token_ids=frozenset(), max_model_len=core.max_model_len,
                                 arrival_time=time.perf_counter()))
    times = []
    while core.has_unfinished_requests():
        decoding = (len(core.scheduler.running) == batch and not core.scheduler.waiting
                    and all(r.num_output_tokens > 0 for r in core.scheduler.running))
        if core.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        core.step()
        if core.device.type == "cuda":
            torch.cuda.synchronize()
        if decoding:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0,
                        help="the device's memory bandwidth for the floor (GB/s; default an H200's 4,800)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, to check the script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.decode_steps < 4:
        parser.error("--decode-steps must be at least 4 (the first two decode steps of each run are not timed)")

    if args.dry_run:
        config = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=2048, tie_word_embeddings=False)
        device, dtype, kernels, hbm = torch.device("cpu"), torch.float32, "torch", 40e9
        args.batches, args.decode_steps, args.rounds = [1, 4], 8, 1
    else:
        config = preset(args.model)
        device, dtype, kernels, hbm = torch.device("cuda"), torch.bfloat16, "triton", args.hbm_gbps * 1e9
    model = random_model(config, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                    * model.embed_tokens.weight.element_size())
    options = dict(max_num_batched_tokens=4096, max_num_seqs=max(args.batches), enable_prefix_caching=False,
                   kernel_backend=kernels, block_size=16)
    cores = {}
    for compiled in (False, True):
        extra = dict(compile_decode=True, compile_batch_sizes=tuple(args.batches)) if compiled else {}
        start = time.perf_counter()
        cores[compiled] = EngineCore(model, EngineConfig.from_options({**options, **extra}), 4096)
        print(f"{'compiled' if compiled else 'eager'} core built in {time.perf_counter() - start:.1f} s", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    rows = []
    for batch in args.batches:
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds + 1):  # round 0 warms up (Triton compiles, graphs captured)
            for compiled in (False, True):
                t = decode_step_times(cores[compiled], batch, args.prompt_len, args.decode_steps,
                                      config.vocab_size, seed=r)
                if r:
                    times[compiled] += t[2:]
        context = args.prompt_len + args.decode_steps / 2
        floor_ms = (weight_bytes + batch * context * kv_per_token) / hbm * 1e3
        eager, comp = times[False], times[True]
        rows.append((batch, min(eager) * 1e3, statistics.median(eager) * 1e3, min(comp) * 1e3,
                     statistics.median(comp) * 1e3, floor_ms))
        print(f"B={batch}: eager {rows[-1][1]:.2f}/{rows[-1][2]:.2f} ms, compiled {rows[-1][3]:.2f}/{rows[-1][4]:.2f}"
              f" ms (min/median), floor {floor_ms:.2f} ms", flush=True)
    lines = [f"# Decode step, eager vs compile_decode: {args.model} ({'tiny' if args.dry_run else 'full'} shape), "
             f"{str(dtype).removeprefix('torch.')}, {name}, torch {torch.__version__}",
             "", f"Prompts of {args.prompt_len} tokens, {args.decode_steps} decode steps each, {args.rounds} rounds "
             "interleaved; floor = weights + the batch's K/V read once at the HBM bandwidth.", "",
             "| batch | eager min / median (ms) | compiled min / median (ms) | eager / compiled (median) "
             "| floor (ms) | compiled / floor |", "| --- | --- | --- | --- | --- | --- |"]
    for b, emin, emed, cmin, cmed, floor in rows:
        lines.append(f"| {b} | {emin:.2f} / {emed:.2f} | {cmin:.2f} / {cmed:.2f} | {emed / cmed:.2f}x | {floor:.2f} "
                     f"| {cmed / floor:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
