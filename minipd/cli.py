"""Command line: ``python -m minipd generate "def fib(n):"`` and ``python -m minipd info``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn


def _generate(args: argparse.Namespace) -> int:
    from minipd import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            top_k=args.top_k, top_p=args.top_p)
    llm = LLM(args.model, device=args.device)
    sys.stdout.write(args.prompt)
    last = None
    for delta in llm.stream(args.prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        last = delta
    assert last is not None  # a request always yields at least one token
    m = last.output.metrics
    tpot = f"{m.tpot * 1e3:.2f} ms" if m.tpot is not None else "n/a (one token)"
    print(f"\n\n[{len(last.output.token_ids)} tokens, finish: {last.finish_reason}] "
          f"TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}")
    return 0


def _info(_: argparse.Namespace) -> int:
    import torch

    import minipd
    from minipd.device import default_device, default_dtype
    from minipd.kernels.backend import kernel_backends
    from minipd.models.registry import BUNDLED_MODELS, bundled_models_dir

    device = default_device()
    print(f"minipd {minipd.__version__}, torch {torch.__version__}")
    print(f"device: {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"dtype {str(default_dtype(device)).replace('torch.', '')}, {torch.get_num_threads()} threads")
    print(f"bundled models ({bundled_models_dir()}):")
    for name, about in BUNDLED_MODELS.items():
        present = (bundled_models_dir() / name / "config.json").exists()
        print(f"  {name:<12} {about}{'' if present else '  [missing]'}")
    print("kernel backends:")
    for name, state in kernel_backends().items():
        print(f"  {name:<12} {state}")
    return 0


def _build_kernels(_: argparse.Namespace) -> int:
    from minipd.kernels.cpu_paged_attention import load_kernel

    print("building the C++ CPU paged-attention kernel (about a minute the first time; cached after)...", flush=True)
    module, why = load_kernel()
    if module is None:
        print(f"not built: {why}; the engine keeps the torch reference (kernel_backend='torch')")
    else:
        from minipd.kernels.isa import ISA_ENV, kernel_isa

        print(f"built, with the {module.compiled_isa()} paths ({ISA_ENV}={kernel_isa()}): kernel_backend='cpu' is "
              "now the default on this machine's CPU")
    import torch

    from minipd.engine.measure import measure_linear_backend
    from minipd.kernels.measured import save_choice

    threads = torch.get_num_threads()
    for count in sorted({1, threads}):  # (one thread: what a disaggregated worker runs on by default)
        torch.set_num_threads(count)
        print(f"timing the linear layers on {count} thread(s): torch's F.linear against oneDNN's packed "
              "weights and minipd's C++ panel kernel...", flush=True)
        record = measure_linear_backend()
        path = save_choice("linear_backend", record, threads=count)
        ratio = (", ".join(f"{name} {r:.2f}x" for name, r in record["ratios"].items() if name != "torch")
                 + " torch's time") if record.get("ratios") else record.get("why", "")
        print(f"linear_backend='auto' will use {record['choice']!r} on {count} thread(s) here ({ratio}; "
              f"kept in {path})")
    torch.set_num_threads(threads)
    from minipd.engine.measure import measure_narrow_matmul_rows

    print("timing fp32, bf16 and fp16 linears: oneDNN's (fp32) or torch's product against minipd's panel "
          "kernel...", flush=True)
    record = measure_narrow_matmul_rows()
    save_choice("narrow_matmul_rows", record, threads=threads)
    for name, rows in record["choice"].items():
        other = "oneDNN's packed product" if name == "float32" else "torch's product"
        print(f"{name} linears will multiply through the panel kernel "
              + (f"up to {rows - 1} rows and through {other} from {rows}" if rows else "at every size"))
    if threads > 1:
        from minipd.engine.measure import measure_small_step_tokens

        print(f"timing small steps on 1 thread against {threads}...", flush=True)
        record = measure_small_step_tokens(threads)
        save_choice("small_step_tokens", record, threads=threads)
        print(f"cpu_threads='auto' will run steps of up to {record['choice']} tokens on one thread here")
    return 0 if module is not None else 1


def _non_negative_seconds(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def _worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from minipd.pd.worker import run_launched_worker

    secret = Path(args.secret_file) if args.secret_file else None
    return run_launched_worker(args.connect, args.role, args.host, args.num_prefill_workers, args.join_timeout,
                               secret, args.front_end_grace)


def _bench(args: argparse.Namespace) -> int:
    from minipd.bench import main as bench_main

    return bench_main(args.bench_args)


def _kvquality(args: argparse.Namespace) -> int:
    from minipd.evaluation.kv_quality import main as quality_main

    return quality_main(args.quality_args)


def _serve(args: argparse.Namespace) -> int:
    import threading

    from tqdm.std import tqdm

    from minipd.serve.server import main as serve_main

    # (tqdm's default lock includes a multiprocessing semaphore, which the os._exit below would leak.)
    tqdm.set_lock(threading.RLock())
    code = serve_main(args)
    from minipd.engine.compiled_decode import compiling_in_background

    if compiling_in_background():
        # The engine is shut down, but the interpreter's teardown would wait seconds for the program the
        # compiler is tracing (it cannot be interrupted): this process has nothing left to do, so end it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _loadgen(args: argparse.Namespace) -> int:
    from minipd.serve.loadgen import main as loadgen_main

    return loadgen_main(args.loadgen_args)


def _moebalance(args: argparse.Namespace) -> int:
    from minipd.evaluation.moe_balance import main as balance_main

    return balance_main(args.balance_args)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage mistakes reach :func:`main` as ``ValueError``, reported like every other error."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see `{self.prog} -h`)")


def _simulate(args: argparse.Namespace) -> int:
    from minipd.sim.cli import main as simulate_main

    return simulate_main(args.simulate_args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m minipd", description="minipd: a small LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a continuation of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="tiny-py", help="bundled name, local HF folder or hub id (default tiny-py)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    gen.set_defaults(func=_generate)
    info = sub.add_parser("info", help="bundled models, device and kernel backends")
    info.set_defaults(func=_info)
    build = sub.add_parser("build-kernels", help="compile the C++ CPU paged-attention kernel (kernel_backend='cpu')")
    build.set_defaults(func=_build_kernels)
    worker = sub.add_parser("worker", help="a prefill or decode worker joining a DisaggregatedLLM(listen=...)",
                            description="Start one disaggregated worker (here, on another machine, or under "
                                        "torchrun) that joins the front end listening at --connect.")
    worker.add_argument("--connect", required=True, help="the front end's listen address, e.g. tcp://10.0.0.1:5557")
    worker.add_argument("--role", choices=("prefill", "decode"), default=None,
                        help="what this worker does (under torchrun, by default from RANK)")
    worker.add_argument("--host", default="127.0.0.1",
                        help="the address of this machine the front end and other workers reach (default 127.0.0.1)")
    worker.add_argument("--num-prefill-workers", type=int, default=1,
                        help="under torchrun without --role: ranks below this prefill (default 1)")
    worker.add_argument("--join-timeout", type=float, default=300.0,
                        help="seconds to wait for the front end (default 300)")
    worker.add_argument("--front-end-grace", type=_non_negative_seconds, default=5.0,
                        help="seconds to go on once the connection to the front end has closed without a shutdown "
                             "(its process killed or crashed), then leave with exit status 1 (default 5)")
    worker.add_argument("--secret-file", default=None,
                        help="file holding the cluster secret every message is signed with (default: "
                             "$MINIPD_CLUSTER_SECRET, else $MINIPD_CLUSTER_SECRET_FILE, else "
                             "~/.config/minipd/cluster-secret)")
    worker.set_defaults(func=_worker)
    serve = sub.add_parser("serve", help="the OpenAI-compatible server (colocated, or disaggregated with "
                           "--prefill-workers)", description="Serve a model over the OpenAI API on 127.0.0.1 "
                           "(--host to change): /v1/completions, /v1/chat/completions, /metrics, /health.")
    from minipd.serve.server import add_arguments as serve_arguments

    serve_arguments(serve)
    serve.set_defaults(func=_serve)
    loadgen = sub.add_parser("loadgen", help="load-test a server: latency percentiles and goodput "
                             "(see `python -m minipd loadgen -h`)", add_help=False)
    loadgen.add_argument("loadgen_args", nargs=argparse.REMAINDER)
    loadgen.set_defaults(func=_loadgen)
    bench = sub.add_parser("bench", help="minipd against HF transformers (see `python -m minipd bench -h`)",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    quality = sub.add_parser("kvquality", help="what compressed KV caches cost in quality "
                             "(see `python -m minipd kvquality -h`)", add_help=False)
    quality.add_argument("quality_args", nargs=argparse.REMAINDER)
    quality.set_defaults(func=_kvquality)
    balance = sub.add_parser("moebalance", help="how unevenly a MoE model loads its experts, and what capping "
                             "it costs (see `python -m minipd moebalance -h`)", add_help=False)
    balance.add_argument("balance_args", nargs=argparse.REMAINDER)
    balance.set_defaults(func=_moebalance)
    simulate = sub.add_parser("simulate", help="a GPU cluster, colocated or disaggregated, simulated: latencies, "
                              "goodput, the best placement (see `python -m minipd simulate -h`)", add_help=False)
    simulate.add_argument("simulate_args", nargs=argparse.REMAINDER)
    simulate.set_defaults(func=_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m minipd`` and the ``minipd`` script.

    Errors never show a traceback: each is one ``error: ...`` line on stderr. Exit status 2 means
    bad input (arguments, model name, device, a corrupt or missing model file), 1 an unexpected
    failure (its exception type is named), 130 Ctrl-C.
    """
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["bench"]:  # the benchmark has its own options; hand them over untouched
            return _bench(argparse.Namespace(bench_args=argv[1:]))
        if argv[:1] == ["kvquality"]:  # likewise
            return _kvquality(argparse.Namespace(quality_args=argv[1:]))
        if argv[:1] == ["loadgen"]:
            return _loadgen(argparse.Namespace(loadgen_args=argv[1:]))
        if argv[:1] == ["moebalance"]:
            return _moebalance(argparse.Namespace(balance_args=argv[1:]))
        if argv[:1] == ["simulate"]:
            return _simulate(argparse.Namespace(simulate_args=argv[1:]))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:  # OSError: missing or unreadable files
        return _fail(str(err), 2)
    except Exception as err:
        return _fail(f"{type(err).__name__}: {err}", 1)


def _fail(message: str, status: int) -> int:
    """Print ``message`` as one ``error:`` line (newlines folded) and return ``status``."""
    print(f"error: {' '.join(message.split()) or 'unknown error'}", file=sys.stderr)
    return status
