"""``python -m minipd bench``: minipd against HF transformers on the same model and requests.

The workloads, each timed for both sides in the same run, reported as a ratio:

- ``mixed``: 64 requests, prompts of 16–512 tokens, outputs of 16–256 (``ignore_eos``): offline
  throughput against HF padded ``generate`` and HF continuous batching (``generate_batch``'s manager);
- ``single``: one stream of 256 new tokens: TPOT of the engine as the server runs it (long-lived: decode
  steps compiled), eager, and with int8 weights, against HF ``generate``, HF with a static cache and
  ``torch.compile``, and one pass over the weights at the machine's copy bandwidth;
- ``shared-prefix``: 32 requests sharing a 256-token prefix: prefill tokens computed and mean TTFT
  with prefix caching on and off;
- ``pd`` (run on its own): prefill/decode interference, colocated against split workers
  (:mod:`minipd.bench.pd`);
- ``adaptive`` (run on its own): every KV format in the same memory under growing bursts: preemptions,
  concurrency and quality (:mod:`minipd.bench.adaptive`);
- ``moe`` (run on its own): the MoE kernel ladder, loop against grouped matmul (and the fused Triton
  kernel on a GPU) on one MoE layer (:mod:`minipd.bench.moe`);
- ``ep`` (run on its own): expert parallelism over processes, serial against overlapped micro-batches
  against one process, and the bytes each all-to-all moves per wire format (:mod:`minipd.bench.expert_parallel`).

The engine timed as "minipd" is the server's (``long_lived=True``: ``compile_decode="auto"`` compiles its decode
programs in the background); timing starts once every program is ready. Its start is reported (first program
ready, all ready), and a second process then starts the same engine to time a warm start from the on-disk cache.

Readers' own mixes run through the same throughput comparison as ``mixed``: ``--workload random`` (a seeded
random mix, ``--num-requests`` requests, ``--seed``; lognormal prompt and output lengths) or ``--workload
FILE.jsonl`` (one request a line: ``{"prompt_len": n, "output_len": m}``, optionally ``"arrival"``, which this
offline comparison ignores; the format of :func:`minipd.serve.workload.trace_workload`).

Every figure is labelled with the machine it ran on: the CPU's model, the instruction-set features that pick
the fast kernels (AVX-512, AVX512-BF16, AMX) and the thread count.

``--scale`` shrinks every workload (request counts and lengths) for a quick look; ``--rounds`` sets how
many times each system runs, taking turns, for the min and median reported. On a CPU the run starts by
measuring the machine's GEMM peak and memory bandwidth (:mod:`minipd.bench.floor`): throughput is also given
as useful FLOP/s, a share of that peak.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: The named workloads of ``--workload`` (a path to a .jsonl file is the other choice).
WORKLOADS = ("mixed", "single", "shared-prefix", "random", "pd", "adaptive", "moe", "ep", "all")


@dataclass
class Workload:
    """Token-id prompts and per-request output lengths, generated from a seed."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        """Output tokens the workload asks for."""
        return sum(self.output_lens)


#: The lengths of ``--workload random``: lognormal (mean, spread of the log, largest), prompts then outputs.
RANDOM_PROMPT_LENS = "lognormal:192:0.9:640"
RANDOM_OUTPUT_LENS = "lognormal:96:0.8:320"


def random_workload(num_requests: int, vocab_size: int, seed: int = 0, scale: float = 1.0) -> Workload:
    """A seeded random mix: lognormal prompt and output lengths (:data:`RANDOM_PROMPT_LENS`,
    :data:`RANDOM_OUTPUT_LENS`; ``scale`` shrinks them), random token ids."""
    import numpy as np

    from minipd.serve.workload import draw_lengths

    rng = np.random.default_rng(seed)
    prompt_lens = draw_lengths(RANDOM_PROMPT_LENS, num_requests, rng, "prompt lengths")
    output_lens = draw_lengths(RANDOM_OUTPUT_LENS, num_requests, rng, "output lengths")
    ids = random.Random(seed)
    prompts = [[ids.randrange(1, vocab_size) for _ in range(max(1, round(n * scale)))] for n in prompt_lens]
    return Workload(prompts, [max(1, round(n * scale)) for n in output_lens])


def file_workload(path: str, vocab_size: int, max_model_len: int, seed: int = 0) -> Workload:
    """The requests of a JSONL file (``prompt_len``, ``output_len``, optional ``arrival``: see
    :func:`minipd.serve.workload.trace_workload`), as random token ids of those lengths.

    Raises ``ValueError`` naming the line of a request longer than the model takes."""
    from minipd.serve.workload import trace_workload

    planned = trace_workload(path)
    for number, r in enumerate(planned, 1):
        if r.prompt_len + r.output_len > max_model_len:
            raise ValueError(f"{path}: request {number} needs {r.prompt_len} + {r.output_len} tokens; the model "
                             f"takes at most {max_model_len} (max_model_len)")
    ids = random.Random(seed)
    return Workload([[ids.randrange(1, vocab_size) for _ in range(r.prompt_len)] for r in planned],
                    [r.output_len for r in planned])


def machine_label() -> str:
    """The CPU's model, its generation (x86 family and model: one name may cover several), its fast-kernel
    features and torch's thread count, for every figure's line; under an instruction-set limit
    (``MINIPD_CPU_ISA``, ``ATEN_CPU_CAPABILITY``...) also the limits, and what torch's kernels run."""
    from minipd.kernels.isa import isa_limits
    from minipd.kernels.measured import cpu_description

    cpu = cpu_description()
    inside = ", ".join(cpu["features"]) or "no AVX2"
    if cpu.get("id"):
        inside = f"{cpu['id']}; {inside}"
    label = f"{cpu['cpu']} ({inside}), {torch.get_num_threads()} threads"
    limits = isa_limits()
    if limits:  # a limited run: say by what, and what torch's own kernels run
        label += (f"; limited: {', '.join(f'{k}={v}' for k, v in limits.items())} (torch's kernels: "
                  f"{torch.backends.cpu.get_cpu_capability()})")
    return label


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


def run_minipd(llm, workload: Workload, steps: list | None = None) -> Result:
    """Offline generation of the whole workload by minipd's engine, every prompt computed in full; the run's
    :class:`~minipd.engine.stats.StepStats` replace the contents of ``steps`` when it is given."""
    from minipd import SamplingParams

    # Rounds repeat the same prompts: with the prefix cache left from the last round, prefill would be
    # skipped, which no baseline can do.
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine still has requests in progress: its prefix cache cannot be emptied")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    history = llm.engine.step_stats
    before = history[-1].step if history else -1
    seconds, outputs = _timed(lambda: llm.generate(workload.prompts, params, use_tqdm=False))
    produced = sum(len(o.token_ids) for o in outputs)  # type: ignore[attr-defined]
    if steps is not None:
        steps[:] = [s for s in history if s.step > before]
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


def minipd_tpot(llm, prompt: list[int], new_tokens: int) -> float:
    """minipd's time per output token (seconds) for one greedy stream of ``new_tokens`` after ``prompt``."""
    from minipd import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    return out.metrics.tpot


def hf_tpot(hf_model, prompt: list[int], new_tokens: int, pad_id: int, compiled: bool = False) -> float:
    """HF ``generate``'s time per output token (seconds) for one greedy stream: (time for all tokens - time
    for one) / (tokens - 1), so its prefill cancels out.

    ``compiled``: with a static cache of a fixed length and ``torch.compile`` of the forward pass (HF's
    own compile path, switched on for CPUs too). Its first call compiles; call it once before timing.
    """
    from transformers import CompileConfig, StaticCache

    ids = torch.tensor([prompt])
    options: dict = {}
    if compiled:
        config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        config._compile_all_devices = True  # HF compiles on accelerators only unless told
        options["compile_config"] = config

    def timed(n: int) -> float:
        if compiled:  # a fresh cache each call, always as long: the same shapes, no recompilation
            options["past_key_values"] = StaticCache(config=hf_model.config, max_cache_len=len(prompt) + new_tokens)
        # transformers 5 renames past_key_values to cache (and warns); 4.x knows only the old name.
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            return _timed(lambda: hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                    pad_token_id=pad_id, **options))[0]

    return (timed(new_tokens) - timed(1)) / (new_tokens - 1)


def interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each run's value over ``rounds`` rounds, the runs taking turns (a shared, noisy machine drifts)."""
    values: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            values[name].append(run())
    return values


def _compiled_or_why(label: str, llm_class, model: str, **options):
    """An LLM with ``compile_decode=True``, or None after saying why this model cannot have one (MoE, MLA)."""
    try:
        return llm_class(model, compile_decode=True, **options)
    except ValueError as err:
        print(f"  {label}: not run ({err})")
        return None


def _compile_start(llm, began: float, built: float) -> str:
    """Wait for ``llm``'s background compilation (tqdm); one line on how long its start took (``began``: the
    ``perf_counter()`` when ``LLM(...)`` was called; ``built``: seconds it took)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from tqdm.auto import tqdm

    from minipd.engine.program_cache import programs_dir

    compiled = llm.engine.core.runner.compiled
    if compiled is None:
        return f"built in {built:.1f} s"
    with tqdm(total=compiled.num_buckets, desc="compiling decode programs (background)", leave=False) as bar:
        while not compiled.wait_until_compiled(timeout=0.5):
            bar.update(len(compiled.ready or ()) - bar.n)
    ready = compiled.ready_after
    if not ready:
        return f"built in {built:.1f} s; no program compiled (see the log)"
    started = compiled.compile_started - began  # compiling begins in the background while the engine is built
    return (f"built in {built:.1f} s; first decode program ready {started + ready[0]:.1f} s after the start, all "
            f"{len(ready)} after {started + ready[-1]:.1f} s, {len(compiled.loaded)} loaded whole from "
            f"{programs_dir()} (the compiler's own on-disk cache: {cache_dir()})")


WARM_START_SCRIPT = """
import json, sys, time
began = time.perf_counter()
from minipd import LLM
sizes = tuple(json.loads(sys.argv[2]))
llm = LLM(sys.argv[1], long_lived=True, max_num_seqs=max(sizes), compile_batch_sizes=sizes)
built = time.perf_counter() - began
compiled = llm.engine.core.runner.compiled
compiled.wait_until_compiled()
started = compiled.compile_started - began
print(json.dumps({"built": built, "started": started, "ready": [started + t for t in compiled.ready_after],
                  "loaded": len(compiled.loaded)}))
"""


def warm_start(model: str, sizes: tuple[int, ...], timeout: float = 900) -> dict[str, Any]:
    """Start the same long-lived engine in a fresh process (the compiler's on-disk cache now warm): seconds from
    the start (imports included) to the engine built (``built``), to its background compilation started
    (``started``: while it is being built) and to each decode program ready (``ready``), and how many programs
    were loaded whole from minipd's program cache (``loaded``; the others were traced)."""
    out = subprocess.run([sys.executable, "-c", WARM_START_SCRIPT, model, json.dumps(list(sizes))],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"the warm start failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float], scale: float, unit: str) -> str:
    return f"min {min(values) * scale:8.2f} {unit}  median {statistics.median(values) * scale:8.2f} {unit}"


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


#: The share-of-peak target is set for a model of about 50M parameters (``--model random-50m``) and up.
PEAK_TARGET_PARAMETERS = 40_000_000

#: What every target line is labelled with (set by main(): the machine it runs on).
_machine = ""


def _line(label: str, value: float, target: float, better: str) -> str:
    ok = value >= target if better == "higher" else value <= target
    sign = ">=" if better == "higher" else "<="
    where = f"  [{_machine}]" if _machine else ""
    return f"  {label:<52} {value:7.2f}x   target {sign} {target}x  {'met' if ok else 'MISSED'}{where}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print each comparison with its ratio and target."""
    parser = argparse.ArgumentParser(prog="python -m minipd bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-py", help="a bundled model, a folder, or random-50m (random weights)")
    parser.add_argument("--workload", default="all", metavar="{" + ",".join(WORKLOADS) + ",FILE.jsonl}",
                        help="pd: prefill/decode interference, colocated vs split workers (not part of all); "
                             "random: a seeded random mix; FILE.jsonl: your own requests (prompt_len, output_len)")
    parser.add_argument("--num-requests", type=int, default=48, help="requests of --workload random (>= 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --workload random and of a file's token ids")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (0 < s <= 1)")
    parser.add_argument("--no-hf-continuous", action="store_true", help="skip HF's continuous batching baseline")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every system (>= 1)")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error("--scale must be in (0, 1]")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    from minipd.serve.workload import trace_workload

    own_file = args.workload not in WORKLOADS
    if own_file and not (args.workload.endswith(".jsonl") and os.path.isfile(args.workload)):
        parser.error(f"--workload must be one of {', '.join(WORKLOADS)} or an existing .jsonl file, "
                     f"got {args.workload!r}")
    if args.workload == "pd":
        from minipd.bench.pd import main as pd_main

        return pd_main(args.model, args.scale, args.rounds)
    if args.workload == "adaptive":
        from minipd.bench.adaptive import main as adaptive_main

        return adaptive_main(args.model, args.scale)
    if args.workload == "moe":
        from minipd.bench.moe import main as moe_main

        return moe_main("tiny-py-moe" if args.model == "tiny-py" else args.model, args.scale)
    if args.workload == "ep":
        from minipd.bench.expert_parallel import main as ep_main

        return ep_main("tiny-py-moe" if args.model == "tiny-py" else args.model, args.scale)

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from minipd import LLM, SamplingParams
    from minipd.bench.floor import describe, measure_floor, schedule_roofline, workload_flops

    s = args.scale
    if args.model.startswith("random-"):  # a random-weight model of that size, built once in the temp folder
        from minipd.bench.random_models import build_random_model

        args.model = str(build_random_model(args.model))
    # The engine as the server runs it (long-lived: compile_decode="auto" compiles its decode programs, here
    # for the batch sizes the workloads reach), timed once every program is ready.
    from minipd.engine.compiled_decode import bucket_sizes

    largest = max(1, round(64 * s) if args.workload in ("all", "mixed") else 1,
                  round(args.num_requests * s) if args.workload in ("all", "random") else 1,
                  len(trace_workload(args.workload)) if own_file else 1)
    sizes = tuple(bucket_sizes(min(largest, 128)))
    began = time.perf_counter()
    llm = LLM(args.model, long_lived=True, max_num_seqs=max(sizes), compile_batch_sizes=sizes)
    built = time.perf_counter() - began
    start_line = _compile_start(llm, began, built)
    vocab = llm.config.vocab_size
    pad = llm.tokenizer.eos_token_id or 0
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=llm.engine.dtype).to(llm.device).eval()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    global _machine
    _machine = machine_label() if llm.device.type == "cpu" else str(llm.device)
    parameters = sum(p.numel() for p in hf.parameters())
    print(f"model {args.model}: {parameters / 1e6:.1f}M parameters, "
          f"device {llm.device}, {torch.get_num_threads()} threads, scale {s}, "
          f"linears: {llm.engine.core.linear_backend}")
    print(f"  machine: {_machine}, torch {torch.__version__}")
    print(f"  engine: {llm.describe()['compile_decode']}; {start_line}")
    if llm.engine.core.runner.compiled is not None:
        warm = warm_start(args.model, sizes)
        first = warm["ready"][0] - warm["started"]  # the compiler's own warm-up, from its on-disk caches
        print(f"  warm start (a second process, same engine): built {warm['built']:.1f} s after the process started "
              f"(imports and loading included); its first decode program {first:.1f} s after compiling began "
              f"(in the background, {warm['started']:.1f} s after the start), so ready {warm['ready'][0]:.1f} s "
              f"after the start, all {len(warm['ready'])} after {warm['ready'][-1]:.1f} s "
              f"({warm['loaded']} loaded whole from the program cache)   "
              f"target <= 5 s for the first  {'met' if first <= 5 else 'MISSED'}  [{_machine}]")
    floor = measure_floor() if llm.device.type == "cpu" else None
    if floor is not None:
        print(f"  {describe(floor)}")
    workloads = ["mixed", "random", "single", "shared-prefix"] if args.workload == "all" else [args.workload]
    mixes: dict[str, Workload] = {}
    if "mixed" in workloads:
        mixes["mixed"] = make_workload(max(2, round(64 * s)), (16, max(17, round(512 * s))),
                                       (16, max(17, round(256 * s))), vocab)
    if "random" in workloads:
        mixes[f"random, seed {args.seed}"] = random_workload(max(1, round(args.num_requests * s)), vocab, args.seed, s)
    if own_file:
        mixes[args.workload] = file_workload(args.workload, vocab, llm.engine.max_model_len, args.seed)
        print(f"  ({args.workload}: arrival times, if any, are ignored: every request is given at once)")

    others: dict = {}  # engines built once for every mix: eager, eager with plain linears
    for mix_name, w in mixes.items():
        useful = workload_flops(llm.config, [len(p) for p in w.prompts], w.output_lens)
        print(f"\n[{mix_name}] {len(w.prompts)} requests, {sum(map(len, w.prompts))} prompt tokens, "
              f"{w.output_tokens} output tokens, {useful / 1e9:.1f} GFLOP of useful work; "
              f"{args.rounds} interleaved rounds; {_machine}")
        if not others:  # the same engine eager, and eager with plain F.linear: what each part brings
            others["minipd, eager"] = LLM(args.model, max_num_seqs=max(sizes), compile_decode=False)
            if llm.engine.core.linear_backend != "torch":
                others["minipd, eager, F.linear (torch)"] = LLM(args.model, max_num_seqs=max(sizes),
                                                                compile_decode=False, linear_backend="torch")
        engines = {"minipd": llm, **others}
        steps: list = []  # the default engine's last run, for the roofline of its schedule
        systems: dict[str, Callable[[], Result]] = {
            name: functools.partial(run_minipd, engine, w, steps if engine is llm else None)
            for name, engine in engines.items()}
        systems["HF generate (padded)"] = functools.partial(run_hf_padded, hf, w, pad)
        if not args.no_hf_continuous:
            if hf_continuous_batching_available(hf):
                systems["HF generate_batch (continuous)"] = functools.partial(run_hf_continuous, hf, w,
                                                                              never_token=vocab)
            else:
                print("  HF continuous batching: not in this transformers version, not run")
        seconds = interleaved({name: lambda run=run: run().seconds for name, run in systems.items()}, args.rounds)
        if floor is not None:  # measured again after the runs, the higher kept: one busy moment would flatter the share
            floor = floor.best_with(measure_floor())
            print(f"  {describe(floor)} (the higher of two measurements, before and after)")
        median = {name: statistics.median(v) for name, v in seconds.items()}
        for name, v in seconds.items():
            share = f"  {useful / median[name] / floor.fp32_peak:6.1%} of the fp32 GEMM peak" if floor else ""
            print(f"  {name:<32} {_spread(v, 1, 's')}  {w.output_tokens / median[name]:9.1f} output tok/s  "
                  f"{useful / median[name] / 1e9:7.1f} useful GFLOP/s{share}")
        for name in list(seconds)[1:]:
            label, ratio = f"throughput minipd / {name} (medians)", median[name] / median["minipd"]
            if name.startswith("minipd"):  # another configuration of the same engine: a comparison, no target
                print(f"  {label:<52} {ratio:7.2f}x")
            else:
                print(_line(label, ratio, 4.0 if "padded" in name else 3.0, "higher"))
        if floor is not None and steps:
            # What the 4x target asks of this machine: the engine's own steps, each at its roofline.
            bound = schedule_roofline(llm.config, steps, floor, llm.engine.core.dtype.itemsize)
            padded = median.get("HF generate (padded)")
            allows = f"; at it, {padded / bound:.2f}x HF padded `generate`" if padded else ""
            print(f"  roofline of minipd's {len(steps)} steps on this machine (each at max(FLOPs / GEMM peak, bytes / "
                  f"copy bandwidth)): {bound:.2f} s; minipd takes {median['minipd'] / bound:.2f}x it{allows}")
        if floor is not None:
            share = useful / median["minipd"] / floor.fp32_peak
            if parameters >= PEAK_TARGET_PARAMETERS:
                print(_line("useful FLOP/s / fp32 GEMM peak (minipd)", share, 0.5, "higher"))
            else:  # a 5M-parameter model's 256-wide matrices cannot feed the GEMM units: reported only
                print(f"  {'useful FLOP/s / fp32 GEMM peak (minipd)':<52} {share:7.2f}x   (the >= 0.5x target is "
                      "for the ~50M model: --model random-50m)")

    if "single" in workloads:
        new = max(8, round(256 * s))
        prompt = make_workload(1, (32, 32), (new, new), vocab, seed=1).prompts[0]
        print(f"\n[single] one stream, {new} new tokens, {args.rounds} interleaved rounds; {_machine}")
        runs: dict[str, Callable[[], float]] = {"minipd": lambda: minipd_tpot(llm, prompt, new)}
        eager = LLM(args.model, compile_decode=False)
        runs["minipd, eager"] = lambda: minipd_tpot(eager, prompt, new)
        if llm.device.type == "cpu":  # weight-only int8: a quarter of the weight bytes, bf16 products
            int8 = LLM(args.model, weight_dtype="int8", compile_decode=False)
            runs["minipd, int8 weights"] = lambda: minipd_tpot(int8, prompt, new)
            int8_compiled = _compiled_or_why("minipd, int8 weights, compile_decode", LLM, args.model,
                                             weight_dtype="int8", compile_batch_sizes=(1,), max_num_seqs=1)
            if int8_compiled is not None:
                runs["minipd, int8 weights, compile_decode"] = lambda: minipd_tpot(int8_compiled, prompt, new)
        if llm.device.type == "cpu":  # bfloat16 (opt-in): half the weight and K/V bytes, widened to fp32 as read
            bf16 = LLM(args.model, dtype="bfloat16", compile_decode=False)
            runs["minipd, bf16 (eager)"] = lambda: minipd_tpot(bf16, prompt, new)
            bf16_compiled = _compiled_or_why("minipd, bf16, compile_decode", LLM, args.model, dtype="bfloat16",
                                             compile_batch_sizes=(1,), max_num_seqs=1)
            if bf16_compiled is not None:
                runs["minipd, bf16, compile_decode"] = lambda: minipd_tpot(bf16_compiled, prompt, new)
        runs["HF generate"] = lambda: hf_tpot(hf, prompt, new, pad)
        runs["HF static cache + torch.compile"] = lambda: hf_tpot(hf, prompt, new, pad, compiled=True)
        for run in tqdm(list(runs.values()), desc="warm-up (compiles)", leave=False):
            run()  # every compiled program is built here, outside the timed rounds
        tpot = interleaved(runs, args.rounds)
        if floor is not None:  # as for the mixes: the higher of two measurements of the bandwidth
            floor = floor.best_with(measure_floor())
        for name, v in tpot.items():
            print(f"  {name:<40} TPOT {_spread(v, 1e3, 'ms')}")
        mid = {name: statistics.median(v) for name, v in tpot.items()}
        hf_plain, hf_static = mid["HF generate"], mid["HF static cache + torch.compile"]
        print(_line("TPOT minipd / HF generate", mid["minipd"] / hf_plain, 0.5, "lower"))
        print(_line("TPOT minipd / HF static + compile", mid["minipd"] / hf_static, 0.6, "lower"))
        print(f"  {'TPOT minipd eager / HF generate':<52} {mid['minipd, eager'] / hf_plain:7.2f}x")
        if floor is not None:  # a decode step reads every weight once: the memory floor of a token
            weight_bytes = sum(t.numel() * t.element_size() for t in
                               {id(p): p for p in llm.model.parameters()}.values())
            one_pass = weight_bytes / floor.bandwidth
            print(f"  one pass over the weights ({weight_bytes / 1e6:.1f} MB at the copy bandwidth): "
                  f"{one_pass * 1e3:.2f} ms")
            print(_line("TPOT minipd / one pass over the weights", mid["minipd"] / one_pass, 2.0, "lower"))
        if "minipd, bf16 (eager)" in mid:
            print(f"  {'TPOT minipd bf16 (eager) / minipd fp32 eager':<52} "
                  f"{mid['minipd, bf16 (eager)'] / mid['minipd, eager']:7.2f}x   "
                  "(its quality cost: python -m minipd kvquality --methods model-bf16)")
        if "minipd, bf16, compile_decode" in mid:
            print(f"  {'TPOT minipd bf16 compile_decode / minipd (fp32)':<52} "
                  f"{mid['minipd, bf16, compile_decode'] / mid['minipd']:7.2f}x   [{_machine}]")
        if "minipd, int8 weights" in mid:
            print(_line("TPOT minipd int8 weights / HF generate", mid["minipd, int8 weights"] / hf_plain, 0.35,
                        "lower"))
        if "minipd, int8 weights, compile_decode" in mid:
            print(_line("TPOT minipd int8 weights compile_decode / HF generate",
                        mid["minipd, int8 weights, compile_decode"] / hf_plain, 0.35, "lower"))
            print("  (int8 weights' quality cost: python -m minipd kvquality --methods weights-int8)")

    if "shared-prefix" in workloads:
        w = make_workload(max(2, round(32 * s)), (16, max(17, round(64 * s))), (32, 32), vocab, seed=2,
                          shared_prefix=max(16, round(256 * s)))
        on, off = shared_prefix_run(args.model, w, True), shared_prefix_run(args.model, w, False)
        cut = 1 - on["prefill_tokens"] / off["prefill_tokens"]
        print(f"\n[shared-prefix] {len(w.prompts)} requests sharing a {max(16, round(256 * s))}-token prefix; "
              f"{_machine}")
        print(f"  prefill tokens computed: {off['prefill_tokens']:.0f} without caching, {on['prefill_tokens']:.0f} "
              f"with (hit rate {on['hit_rate']:.0%})")
        print(f"  mean TTFT: {off['mean_ttft'] * 1e3:.1f} ms without caching, {on['mean_ttft'] * 1e3:.1f} ms with")
        print(f"  {'prefill tokens cut by prefix caching':<52} {cut:7.1%}   target >= 80%  "
              f"{'met' if cut >= 0.8 else 'MISSED'}")
        print(_line("mean TTFT with / without caching", on["mean_ttft"] / off["mean_ttft"], 0.5, "lower"))
    return 0
