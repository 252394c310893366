"""``python -m minipd bench --workload pd``: prefill/decode interference, colocated against split.

A steady decode load (short prompts, long outputs) runs while bursts of long prompts arrive, on the
same wall-clock schedule for every system:

- ``colocated``: one engine (``LLM``) with both cores, a whole prompt per step (and, for
  reference, the same engine on one thread: on a small model two threads can be slower);
- ``colocated, chunked``: the same engine with a small token budget (chunked prefill, the colocated answer);
- ``split``: ``DisaggregatedLLM`` with one prefill and one decode worker, one core each.

Reported per system: P50/P99 time per output token of the steady requests (every gap between two
tokens), P50/P99 time to first token of the long prompts, and throughput; then the split/colocated
ratio of P99 TPOT (goal: ≤ 0.5). A second workload, short prompts only, shows where splitting loses
(nothing to isolate, half the cores per phase, a hop and a transfer per request). The variants are
interleaved and repeated; min and median are printed. Prefix caching is off everywhere, since
every round replays the same prompts. A last table gives KV bytes and transfer time per request
against prompt length, per transfer mode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from minipd.sampling_params import SamplingParams


@dataclass
class Arrival:
    """One request of the schedule: when it arrives (seconds from the start), its prompt and length."""

    at: float
    prompt: list[int]
    max_tokens: int
    steady: bool  # its gaps count towards TPOT; the others' first tokens count towards TTFT
    timed: bool = False  # its first token counts towards TTFT even though it is steady


def schedule(vocab_size: int, scale: float = 1.0, seed: int = 0) -> list[Arrival]:
    """Steady requests at t=0, then bursts of long prompts every 0.6 s."""
    import random

    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab_size) for _ in range(max(2, int(n * scale)))]

    steady = [Arrival(0.0, prompt(32), max(8, int(160 * scale)), True) for _ in range(6)]
    bursts = [Arrival(0.3 + 0.6 * b, prompt(768), 4, False) for b in range(3) for _ in range(3)]
    return steady + bursts


def schedule_short(vocab_size: int, scale: float = 1.0, seed: int = 1) -> list[Arrival]:
    """Where splitting loses: only short prompts (nothing long to interfere), one every 40 ms."""
    import random

    rng = random.Random(seed)
    return [Arrival(0.04 * i, [rng.randrange(1, vocab_size) for _ in range(max(2, int(48 * scale)))],
                    max(8, int(64 * scale)), True, timed=True) for i in range(16)]


@dataclass
class Run:
    """One system's run of the schedule."""

    system: str
    tpot: list[float]
    ttft: list[float]
    seconds: float
    output_tokens: int

    def pct(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def drive(add: Callable[[list[int], SamplingParams], str], step: Callable[[], object],
          unfinished: Callable[[], bool], outputs: Callable[[str], object], arrivals: list[Arrival],
          system: str) -> Run:
    """Feed ``arrivals`` on the wall clock into a system and step it until everything is done."""
    start = time.perf_counter()
    ids: list[tuple[str, Arrival]] = []
    pending = sorted(arrivals, key=lambda a: a.at)
    while pending or unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            ids.append((add(a.prompt, SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)), a))
        if unfinished():
            step()
        else:
            time.sleep(0.001)
    seconds = time.perf_counter() - start
    tpot, ttft, produced = [], [], 0
    for request_id, a in ids:
        out = outputs(request_id)
        m = out.metrics  # type: ignore[attr-defined]
        produced += len(out.token_ids)  # type: ignore[attr-defined]
        if a.steady:
            tpot += m.inter_token_latencies
        if (a.timed or not a.steady) and m.ttft is not None:
            ttft.append(m.ttft)
    return Run(system, tpot, ttft, seconds, produced)


def run_colocated(llm, arrivals: list[Arrival], system: str) -> Run:
    """The schedule on one engine, stepped in this process."""
    engine = llm.engine
    states = {}

    def add(prompt: list[int], params: SamplingParams) -> str:
        state = engine.make_request(prompt, params)
        engine.add(state)
        states[state.request_id] = state
        return state.request_id

    return drive(add, engine.step, engine.has_unfinished_requests, lambda rid: states[rid].to_output(), arrivals,
                 system)


def run_split(pd, arrivals: list[Arrival]) -> Run:
    """The schedule on a DisaggregatedLLM."""
    states = {}

    def add(prompt: list[int], params: SamplingParams) -> str:
        request_id = pd.add_request(prompt, params)
        states[request_id] = pd.processor.states[request_id]
        return request_id

    return drive(add, lambda: pd.step(0.002), pd.has_unfinished_requests, lambda rid: states[rid].to_output(),
                 arrivals, "split (1 prefill + 1 decode worker)")


def main(model: str = "tiny-py", scale: float = 1.0, rounds: int = 2) -> int:
    """Run the interference and transfer measurements and print them."""
    import torch

    from minipd import LLM, DisaggregatedLLM

    torch.set_num_threads(2)
    # Prefix caching off everywhere: every round replays the same prompts, and a cache hit would turn a
    # later round's 768-token prefill into a lookup (and the systems share nothing else between rounds).
    colocated = LLM(model, enable_prefix_caching=False)
    chunked = LLM(model, max_num_batched_tokens=64, enable_prefix_caching=False)
    arrivals = schedule(colocated.config.vocab_size, scale)
    shorts = schedule_short(colocated.config.vocab_size, scale)
    runs: dict[str, list[Run]] = {}
    short_runs: dict[str, list[Run]] = {}
    with DisaggregatedLLM(model, threads_per_worker=1, enable_prefix_caching=False) as pd:
        warm = [[5] * 16]
        colocated.generate(warm, SamplingParams(max_tokens=4))
        chunked.generate(warm, SamplingParams(max_tokens=4))
        pd.generate(warm, SamplingParams(max_tokens=4))
        for _ in range(rounds):  # interleaved, so a noisy moment hits every system alike
            torch.set_num_threads(1)
            one_thread = run_colocated(colocated, arrivals, "colocated, 1 thread")
            torch.set_num_threads(2)
            for run in (run_colocated(colocated, arrivals, "colocated"), one_thread,
                        run_colocated(chunked, arrivals, "colocated, chunked prefill (64-token budget)"),
                        run_split(pd, arrivals)):
                runs.setdefault(run.system, []).append(run)
            for run in (run_colocated(colocated, shorts, "colocated"), run_split(pd, shorts)):
                short_runs.setdefault(run.system, []).append(run)
    transfer = {}
    variants = {"pull": {}, "push": {}, "layerwise": {}, "layerwise, int8": {"kv_cache_dtype": "int8"},
                # The pools stay fp32; only the wire is int8 (the torch transport: NIXL moves memory as it lies).
                "layerwise, int8 wire": {"kv_transfer_dtype": "int8", "kv_transport": "torch"}}
    for name, options in variants.items():
        with DisaggregatedLLM(model, threads_per_worker=1, kv_transfer=name.split(",")[0], enable_prefix_caching=False,
                              **options) as pd:
            pd.generate([[5] * 16], SamplingParams(max_tokens=2))
            transfer[name] = measure_transfer(pd, colocated.config.vocab_size, scale)
    print(f"\n[pd] {sum(a.steady for a in arrivals)} steady requests, bursts of {sum(not a.steady for a in arrivals)} "
          f"long prompts; {rounds} interleaved rounds, min / median of each figure")
    summary = _table(runs)
    split, colo = summary["split (1 prefill + 1 decode worker)"], summary["colocated"]
    ratio = split["tpot99"][1] / colo["tpot99"][1]
    print(f"  P99 TPOT split / colocated (medians)                   {ratio:5.2f}x   target <= 0.5x  "
          f"{'met' if ratio <= 0.5 else 'MISSED'}")
    print(f"  P99 TTFT split / colocated (medians)                   {split['ttft99'][1] / colo['ttft99'][1]:5.2f}x")
    print(f"\n[pd, short prompts only] {len(shorts)} requests, nothing long to interfere: where splitting loses")
    summary = _table(short_runs)
    split, colo = summary["split (1 prefill + 1 decode worker)"], summary["colocated"]
    for name, key in (("P50 TPOT", "tpot50"), ("P50 TTFT", "ttft50"), ("throughput", "tput")):
        print(f"  {name + ' split / colocated (medians)':54} {split[key][1] / colo[key][1]:5.2f}x")
    print("\n[pd transfer] KV moved per request (NIXL where installed; the wire-int8 row over torch), by mode and")
    print("  prompt length (median of three).")
    print("  'in prefill': share of the transfer's span inside the prefill step; 'after': what the decode side")
    print("  still waits once the prefill is done. On a CPU the writes run on the prefill worker's own thread,")
    print("  so a layer-wise transfer is interleaved with compute (and lengthens the step), not parallel to it.")
    print(f"  {'mode':20} {'prompt':>7} {'MiB':>8} {'span ms':>8} {'GB/s':>7} {'in prefill':>11} {'after ms':>9}")
    for mode, rows in transfer.items():
        for length, (num_bytes, ms, hidden) in rows.items():
            inside = "" if hidden is None else f"{hidden:.0%}"
            after = "" if hidden is None else f"{(1 - hidden) * ms:.2f}"
            print(f"  {mode:20} {length:7d} {num_bytes / 2**20:8.2f} {ms:8.2f} {num_bytes / max(ms, 1e-6) / 1e6:7.2f} "
                  f"{inside:>11} {after:>9}")
    longest = max(transfer["layerwise"])
    saved = transfer["layerwise, int8"][longest][0] / transfer["layerwise"][longest][0]
    print(f"  an int8 cache moves {saved:.3f}x the bytes of the model's own ({longest}-token prompt, scales included)")
    wire = transfer["layerwise, int8 wire"][longest][0] / transfer["layerwise"][longest][0]
    print(f"  an fp32 cache sent as int8 (kv_transfer_dtype) moves {wire:.3f}x; its decode worker reads int8-rounded "
          "prompt K/V")
    long_layerwise = [h for n, (_, _, h) in transfer["layerwise"].items() if n >= 512 and h is not None]
    if long_layerwise:
        share = statistics.median(long_layerwise)
        print(f"  layer-wise share inside the prefill step, prompts >= 512 tokens   {share:5.0%}   target >= 70%  "
              f"{'met' if share >= 0.7 else 'MISSED'}")
    return 0


def _table(runs: dict[str, list[Run]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Print one row per system (min / median over rounds, in ms; throughput median) and return the figures."""
    print(f"  {'system':48} {'TPOT P50':>10} {'TPOT P99':>10} {'TTFT P50':>10} {'TTFT P99':>10} {'tok/s':>8}")
    summary = {}
    for system, rs in runs.items():
        figures = {
            "tpot50": [r.pct(r.tpot, 0.5) * 1e3 for r in rs], "tpot99": [r.pct(r.tpot, 0.99) * 1e3 for r in rs],
            "ttft50": [r.pct(r.ttft, 0.5) * 1e3 for r in rs], "ttft99": [r.pct(r.ttft, 0.99) * 1e3 for r in rs],
            "tput": [r.output_tokens / r.seconds for r in rs]}
        summary[system] = {k: (min(v), statistics.median(v)) for k, v in figures.items()}
        s = summary[system]
        print(f"  {system:48} " + " ".join(f"{s[k][0]:6.1f}/{s[k][1]:<5.1f}" if k != "tput" else f"{s[k][1]:8.0f}"
                                           for k in ("tpot50", "tpot99", "ttft50", "ttft99", "tput")))
    return summary


def measure_transfer(pd, vocab_size: int, scale: float) -> dict[int, tuple[int, float, float | None]]:
    """KV bytes, transfer time and share hidden behind compute of one request per prompt length (median of three)."""
    import random

    rng = random.Random(1)
    result = {}
    for length in (64, 256, 1000):
        n = max(16, int(length * scale))
        times, hidden, moved = [], [], 0
        for _ in range(3):
            prompt = [rng.randrange(1, vocab_size) for _ in range(n)]  # fresh, so no prefix-cache hit
            (out,) = pd.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            m = out.metrics
            moved = m.kv_transfer_bytes
            times.append((m.kv_transfer_end - m.kv_transfer_start) * 1e3 if m.kv_transfer_end else float("nan"))
            if m.kv_transfer_hidden is not None:
                hidden.append(m.kv_transfer_hidden)
        result[n] = (moved, statistics.median(times), statistics.median(hidden) if hidden else None)
    return result
