"""``python -m minipd bench``: minipd against HF transformers on the same model and requests.

Three workloads, each timed for both sides in the same run, reported as a ratio:

- ``mixed``: 64 requests, prompts of 16–512 tokens, outputs of 16–256 (``ignore_eos``): offline
  throughput against HF padded ``generate`` and HF continuous batching (``generate_batch``'s manager);
- ``single``: one stream of 256 new tokens: TPOT against HF ``generate``;
- ``shared-prefix``: 32 requests sharing a 256-token prefix: prefill tokens computed and mean TTFT
  with prefix caching on and off;
- ``pd`` (run on its own): prefill/decode interference, colocated against split workers
  (:mod:`minipd.bench_pd`);
- ``adaptive`` (run on its own): every KV format in the same memory under growing bursts: preemptions,
  concurrency and quality (:mod:`minipd.bench_adaptive`);
- ``moe`` (run on its own): the MoE kernel ladder, loop against grouped matmul (and the fused Triton
  kernel on a GPU) on one MoE layer (:mod:`minipd.bench_moe`);
- ``ep`` (run on its own): expert parallelism over processes, serial against overlapped micro-batches
  against one process, and the bytes each all-to-all moves per wire format (:mod:`minipd.bench_ep`).

``--scale`` shrinks every workload (request counts and lengths) for a quick look.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Workload:
    """Token-id prompts and per-request output lengths, generated from a seed."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        """Output tokens the workload asks for."""
        return sum(self.output_lens)


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int = 0, shared_prefix: int = 0) -> Workload:
    """Random prompts (ids 1..vocab-1) and output lengths, uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab_size) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(1, vocab_size) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    outputs = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, outputs)


@dataclass
class Result:
    """One system's run of one workload."""

    system: str
    seconds: float
    output_tokens: int
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def run_minipd(llm, workload: Workload) -> Result:
    """Offline generation of the whole workload by minipd's engine."""
    from minipd import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    seconds, outputs = _timed(lambda: llm.generate(workload.prompts, params, use_tqdm=False))
    produced = sum(len(o.token_ids) for o in outputs)  # type: ignore[attr-defined]
    return Result("minipd", seconds, produced)


def run_hf_padded(model, workload: Workload, pad_id: int) -> Result:
    """HF ``generate`` on the whole workload as one left-padded batch, until the longest output is done."""
    longest = max(len(p) for p in workload.prompts)
    ids = torch.full((len(workload.prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(workload.prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    new = max(workload.output_lens)
    with torch.inference_mode():
        seconds, _ = _timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                                   min_new_tokens=new, do_sample=False, pad_token_id=pad_id))
    # Only the tokens each request asked for count: the rest is padding work a padded batch cannot skip.
    return Result("HF generate (padded)", seconds, workload.output_tokens)


def hf_continuous_batching_available(model) -> bool:
    """Whether the installed transformers has continuous batching (``generate_batch``)."""
    return hasattr(model, "continuous_batching_context_manager")


def run_hf_continuous(model, workload: Workload, never_token: int, max_batch_tokens: int = 2048) -> Result:
    """HF's continuous-batching manager, each request with its own output length and EOS ignored.

    It is given the same token budget as minipd and a KV cache sized for the workload: left to
    size itself it assumes a GPU, and on a CPU runs an order of magnitude slower.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=never_token,
                              pad_token_id=0)
    page = 256
    total = sum(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=-(-total // page) + len(workload.prompts),
                                         max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
                                         use_async_batching=False)

    def go() -> int:
        produced = 0
        with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                       block=True, timeout=5, warmup=False) as manager:
            for p, n in zip(workload.prompts, workload.output_lens, strict=True):
                manager.add_request(p, max_new_tokens=n, eos_token_id=never_token)
            done = 0
            while done < len(workload.prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
        return produced

    seconds, produced = _timed(go)
    return Result("HF generate_batch (continuous)", seconds, int(produced))  # type: ignore[arg-type]


def single_stream_tpot(llm, hf_model, prompt: list[int], new_tokens: int, pad_id: int) -> tuple[float, float]:
    """(minipd TPOT, HF TPOT) in seconds for one stream of ``new_tokens`` after ``prompt``.

    HF's TPOT is (time for all tokens - time for one token) / (tokens - 1): its prefill cancels out.
    """
    from minipd import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    ids = torch.tensor([prompt])

    def hf(n: int) -> float:
        with torch.inference_mode():
            return _timed(lambda: hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                    pad_token_id=pad_id))[0]

    hf(2)  # warm-up
    hf_tpot = (min(hf(new_tokens) for _ in range(2)) - min(hf(1) for _ in range(2))) / (new_tokens - 1)
    return out.metrics.tpot, hf_tpot  # type: ignore[return-value]


def shared_prefix_run(model_name: str, workload: Workload, caching: bool) -> dict[str, float]:
    """Prefill tokens computed and mean TTFT for the workload, with prefix caching on or off."""
    from minipd import LLM, SamplingParams

    llm = LLM(model_name, enable_prefix_caching=caching)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up, shares nothing with the workload
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    return {"prefill_tokens": float(sum(o.metrics.prefill_tokens for o in outs)),
            "mean_ttft": statistics.mean(o.metrics.ttft for o in outs),  # type: ignore[misc]
            "hit_rate": llm.engine.block_manager.stats.hit_rate}


def _line(label: str, value: float, target: float, better: str) -> str:
    ok = value >= target if better == "higher" else value <= target
    sign = ">=" if better == "higher" else "<="
    return f"  {label:<52} {value:7.2f}x   target {sign} {target}x  {'met' if ok else 'MISSED'}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print each comparison with its ratio and target."""
    parser = argparse.ArgumentParser(prog="python -m minipd bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-py", help="a bundled model, a folder, or random-50m (random weights)")
    parser.add_argument("--workload", choices=["mixed", "single", "shared-prefix", "pd", "adaptive", "moe", "ep",
                                                   "all"],
                        default="all",
                        help="pd: prefill/decode interference, colocated vs split workers (not part of all)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (0 < s <= 1)")
    parser.add_argument("--no-hf-continuous", action="store_true", help="skip HF's continuous batching baseline")
    parser.add_argument("--rounds", type=int, default=3, help="pd: interleaved repetitions of every system (>= 1)")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error("--scale must be in (0, 1]")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.workload == "pd":
        from minipd.bench_pd import main as pd_main

        return pd_main(args.model, args.scale, args.rounds)
    if args.workload == "adaptive":
        from minipd.bench_adaptive import main as adaptive_main

        return adaptive_main(args.model, args.scale)
    if args.workload == "moe":
        from minipd.bench_moe import main as moe_main

        return moe_main("tiny-py-moe" if args.model == "tiny-py" else args.model, args.scale)
    if args.workload == "ep":
        from minipd.bench_ep import main as ep_main

        return ep_main("tiny-py-moe" if args.model == "tiny-py" else args.model, args.scale)

    from transformers import AutoModelForCausalLM

    from minipd import LLM, SamplingParams
    from minipd.floor import describe, measure_floor, workload_flops

    s = args.scale
    if args.model.startswith("random-"):  # a random-weight model of that size, built once in the temp folder
        from minipd.random_models import build_random_model

        args.model = str(build_random_model(args.model))
    llm = LLM(args.model)
    vocab = llm.config.vocab_size
    pad = llm.tokenizer.eos_token_id or 0
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=llm.engine.dtype).to(llm.device).eval()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    print(f"model {args.model}: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters, "
          f"device {llm.device}, {torch.get_num_threads()} threads, scale {s}, "
          f"linears: {llm.engine.core.linear_backend}")
    floor = measure_floor() if llm.device.type == "cpu" else None
    if floor is not None:
        print(f"  {describe(floor)}")
    workloads = ["mixed", "single", "shared-prefix"] if args.workload == "all" else [args.workload]

    if "mixed" in workloads:
        w = make_workload(max(2, round(64 * s)), (16, max(17, round(512 * s))), (16, max(17, round(256 * s))), vocab)
        useful = workload_flops(llm.config, [len(p) for p in w.prompts], w.output_lens)
        print(f"\n[mixed] {len(w.prompts)} requests, {sum(map(len, w.prompts))} prompt tokens, "
              f"{w.output_tokens} output tokens, {useful / 1e9:.1f} GFLOP of useful work")
        ours = run_minipd(llm, w)
        rows = [ours]
        if llm.engine.core.linear_backend != "torch":  # what the packed linears bring, same run
            plain = run_minipd(LLM(args.model, linear_backend="torch"), w)
            plain.system = "minipd, F.linear (torch)"
            rows.append(plain)
        rows.append(run_hf_padded(hf, w, pad))
        if not args.no_hf_continuous:
            if hf_continuous_batching_available(hf):
                rows.append(run_hf_continuous(hf, w, never_token=vocab))
            else:
                print("  HF continuous batching: not in this transformers version, not run")
        for r in rows:
            share = f"  {useful / r.seconds / floor.fp32_peak:6.1%} of the fp32 GEMM peak" if floor else ""
            print(f"  {r.system:<32} {r.seconds:8.2f} s  {r.throughput:9.1f} output tok/s  "
                  f"{useful / r.seconds / 1e9:7.1f} useful GFLOP/s{share}")
        for r in rows[1:]:
            target = 1.0 if r.system.startswith("minipd") else 4.0 if "padded" in r.system else 3.0
            print(_line(f"throughput minipd / {r.system}", ours.throughput / r.throughput, target, "higher"))
        if floor is not None:
            print(_line("useful FLOP/s / fp32 GEMM peak (minipd)", useful / ours.seconds / floor.fp32_peak, 0.4,
                        "higher"))

    if "single" in workloads:
        new = max(8, round(256 * s))
        prompt = make_workload(1, (32, 32), (new, new), vocab, seed=1).prompts[0]
        ours_tpot, hf_tpot = single_stream_tpot(llm, hf, prompt, new, pad)
        print(f"\n[single] one stream, {new} new tokens")
        print(f"  minipd TPOT {ours_tpot * 1e3:.2f} ms, HF generate TPOT {hf_tpot * 1e3:.2f} ms")
        print(_line("TPOT minipd / HF generate", ours_tpot / hf_tpot, 0.5, "lower"))
        if llm.device.type == "cpu":  # weight-only int8: a quarter of the weight bytes, bf16 products
            int8 = LLM(args.model, weight_dtype="int8")
            int8.generate([prompt], SamplingParams(max_tokens=4))  # warm-up
            int8_tpot = int8.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0]
            tpot = int8_tpot.metrics.tpot
            print(f"  minipd weight_dtype='int8' TPOT {tpot * 1e3:.2f} ms (quality: python -m minipd kvquality "
                  "--methods weights-int8)")
            print(_line("TPOT minipd int8 weights / HF generate", tpot / hf_tpot, 0.35, "lower"))

    if "shared-prefix" in workloads:
        w = make_workload(max(2, round(32 * s)), (16, max(17, round(64 * s))), (32, 32), vocab, seed=2,
                          shared_prefix=max(16, round(256 * s)))
        on, off = shared_prefix_run(args.model, w, True), shared_prefix_run(args.model, w, False)
        cut = 1 - on["prefill_tokens"] / off["prefill_tokens"]
        print(f"\n[shared-prefix] {len(w.prompts)} requests sharing a {max(16, round(256 * s))}-token prefix")
        print(f"  prefill tokens computed: {off['prefill_tokens']:.0f} without caching, {on['prefill_tokens']:.0f} "
              f"with (hit rate {on['hit_rate']:.0%})")
        print(f"  mean TTFT: {off['mean_ttft'] * 1e3:.1f} ms without caching, {on['mean_ttft'] * 1e3:.1f} ms with")
        print(f"  {'prefill tokens cut by prefix caching':<52} {cut:7.1%}   target >= 80%  "
              f"{'met' if cut >= 0.8 else 'MISSED'}")
        print(_line("mean TTFT with / without caching", on["mean_ttft"] / off["mean_ttft"], 0.5, "lower"))
    return 0
