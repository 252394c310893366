"""Measure minipd's engine on a GPU for the cluster simulator: Poisson runs of a real-size model shape.

A model of a preset's shape (``minipd.sim.costs.MODEL_PRESETS``, Llama-3-8B by default) is built with random
weights in bf16 on the GPU, and its engine core serves seeded Poisson workloads open loop
(``minipd.sim.validate.run_core``): every step's record and every token's time are kept. Chapter 05b and
``tests/test_sim_validation.py`` read the JSON this writes to check the simulator's step-time models (the
roofline's efficiency factors, the fitted model's error) and its request latencies against the real runs.

    python scripts/gpu_sim_calibration.py --out $OUT/h200_engine_runs.json      # on a CUDA machine
    python scripts/gpu_sim_calibration.py --dry-run --out /tmp/runs.json         # anywhere: a tiny model on CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # minipd from this checkout

from minipd.config import ModelConfig
from minipd.engine.config import EngineConfig
from minipd.engine.core import EngineCore
from minipd.models.decoder import DecoderModel
from minipd.serve.workload import synthetic_workload
from minipd.sim.costs import preset
from minipd.sim.validate import run_core


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The model's shape with random weights, made on the device directly (no CPU copy of 16 GB)."""
    with torch.device("meta"):
        model = DecoderModel(config)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.reset_cache(device)
    return model.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rates", type=float, nargs="+", default=[3.0, 6.0, 9.0])
    parser.add_argument("--num-requests", type=int, default=150)
    parser.add_argument("--prompt-lens", default="128:1024")
    parser.add_argument("--output-lens", default="32:256")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, to check the script")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    if args.dry_run:
        config = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=2048, tie_word_embeddings=False)
        device, dtype, kernels = torch.device("cpu"), torch.float32, "torch"
        args.num_requests, args.rates = 20, args.rates[:1]
    else:
        config = preset(args.model)
        device, dtype, kernels = torch.device("cuda"), torch.bfloat16, "triton"
    max_model_len = 4096 if not args.dry_run else 2048
    model = random_model(config, device, dtype)
    options = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                   enable_prefix_caching=False, kernel_backend=kernels, block_size=16)
    core = EngineCore(model, EngineConfig.from_options(options), max_model_len)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    print(f"{args.model} ({'tiny' if args.dry_run else 'full'} shape) on {name}: "
          f"{core.block_manager.num_blocks} KV blocks of 16", flush=True)
    warm = synthetic_workload(16, 1000.0, args.prompt_lens, "4:16", seed=99)
    start = time.perf_counter()
    run_core(core, warm, config.vocab_size)  # first calls compile the Triton kernels
    print(f"warm-up {time.perf_counter() - start:.1f} s", flush=True)
    runs = {}
    for rate in args.rates:
        workload = synthetic_workload(args.num_requests, rate, args.prompt_lens, args.output_lens, seed=int(rate * 10))
        start = time.perf_counter()
        run = run_core(core, workload, config.vocab_size, seed=1)
        done = [r for r in run.results if r.ok]
        ttft = sorted(r.ttft for r in done)[len(done) // 2] * 1e3
        tpot = sorted(r.tpot for r in done)[len(done) // 2] * 1e3
        print(f"rate {rate}: {len(done)}/{len(run.results)} done in {time.perf_counter() - start:.1f} s, "
              f"{len(run.steps)} steps, median TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms", flush=True)
        runs[str(rate)] = json.loads(run.to_json())
    report = {"device": name, "model": args.model, "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "options": options, "max_model_len": max_model_len,
              "num_kv_blocks": core.block_manager.num_blocks, "prompt_lens": args.prompt_lens,
              "output_lens": args.output_lens, "num_requests": args.num_requests, "runs": runs}
    Path(args.out).write_text(json.dumps(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
