"""Adaptive KV precision under load: ``python -m minipd bench --workload adaptive``.

Every cache format gets the same KV memory, sized so that only a few requests fit in full precision,
and the same bursts of requests, from a few (everything fits) to many (the pool overflows). For each
format and burst it counts preemptions (work recomputed), the most requests running at once and the
engine steps to finish, and scores quality as the share of greedy tokens equal to an unconstrained
full-precision run's (a request's tokens after the first difference are compared too, so one early
change costs a lot: this is a strict measure). The claim checked: adaptive holds more requests with
fewer preemptions than full precision, and loses less quality than int4 at every load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minipd.sampling_params import SamplingParams

#: The formats compared: the model's own dtype, two fixed compressed ones, and adaptive.
VARIANTS: dict[str, dict] = {
    "auto": {},
    "int8": {"kv_cache_dtype": "int8"},
    "int4": {"kv_cache_dtype": "int4"},
    "adaptive": {"kv_cache_dtype": "adaptive", "kv_adaptive_thresholds": (0.5, 0.7)},
}


@dataclass
class LoadResult:
    """One format's run of one burst."""

    variant: str
    num_requests: int
    preemptions: int
    max_running: int
    steps: int
    #: Share of output tokens equal to the unconstrained full-precision run's.
    agreement: float
    #: Requests the adaptive engine compressed in place (0 for the others).
    compressions: int = 0


def burst(tokenizer, num_requests: int, prompt_len: int = 96) -> list[list[int]]:
    """``num_requests`` distinct code prompts of ``prompt_len`` tokens from the bundled text."""
    from minipd.evaluation.kv_quality import heldout_text

    ids = tokenizer.encode(heldout_text())
    stride = max(1, (len(ids) - prompt_len) // max(1, num_requests))
    return [ids[i * stride:i * stride + prompt_len] for i in range(num_requests)]


def run_staggered(llm, prompts: Sequence[list[int]], params: SamplingParams, every: int = 3) -> list:
    """Feed ``prompts`` to ``llm``'s engine one every ``every`` steps and run until all finish; return the
    step stats of the run (a load that builds up, to watch the pool fill and the format switch)."""
    engine = llm.engine
    engine.core.step_stats.clear()
    states, step = [], 0
    while len(states) < len(prompts) or not all(s.finished for s in states):
        if len(states) < len(prompts) and step % every == 0:
            states.append(engine.make_request(prompts[len(states)], params))
            engine.add(states[-1])
        engine.step()
        step += 1
    return list(engine.core.step_stats)


def measure(model: str = "tiny-py", loads: Sequence[int] = (2, 4, 8, 16), output_len: int = 64,
            kv_cache_memory: int = 3_000_000, max_num_seqs: int = 16, progress: bool = True) -> list[LoadResult]:
    """Run every variant of :data:`VARIANTS` on bursts of ``loads`` requests in ``kv_cache_memory`` bytes (for
    tiny-py, about six 160-token requests in fp32; KIVI's residual window comes out of the same bytes)."""
    from tqdm.auto import tqdm

    from minipd import LLM

    reference = LLM(model, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engines = {name: LLM(model, enable_prefix_caching=False, kv_cache_memory=kv_cache_memory,
                         max_num_seqs=max_num_seqs, **options) for name, options in VARIANTS.items()}
    results = []
    runs = [(load, name) for load in loads for name in VARIANTS]
    for load, name in tqdm(runs, desc="adaptive under load", disable=not progress):
        prompts = burst(reference.tokenizer, load)
        want = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
        llm = engines[name]
        core = llm.engine.core
        core.step_stats.clear()
        preempted = core.scheduler.num_preemptions
        compressions = getattr(core.block_manager, "num_compressions", 0)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = list(core.step_stats)
        equal = sum(a == b for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
        results.append(LoadResult(name, load, core.scheduler.num_preemptions - preempted,
                                  max(s.num_running for s in stats), len(stats), equal / sum(map(len, want)),
                                  getattr(core.block_manager, "num_compressions", 0) - compressions))
    return results


def format_table(results: Sequence[LoadResult]) -> str:
    """The results as a text table, one row per burst and format."""
    lines = [f"{'requests':>8} {'format':>9} {'preempted':>9} {'running':>7} {'steps':>6} {'agree':>6} "
             f"{'compressed':>10}"]
    for r in results:
        lines.append(f"{r.num_requests:>8} {r.variant:>9} {r.preemptions:>9} {r.max_running:>7} {r.steps:>6} "
                     f"{r.agreement:>6.1%} {r.compressions:>10}")
    return "\n".join(lines)


def verdict(results: Sequence[LoadResult]) -> list[str]:
    """The claims, checked per burst that overflows full precision: one line each, 'met' or 'missed'."""
    by = {(r.variant, r.num_requests): r for r in results}
    lines = []
    for load in sorted({r.num_requests for r in results}):
        full, adaptive, int4 = by[("auto", load)], by[("adaptive", load)], by[("int4", load)]
        if full.preemptions == 0:
            continue
        holds = adaptive.max_running >= full.max_running and adaptive.preemptions < full.preemptions
        better = adaptive.agreement >= int4.agreement
        lines.append(f"{load} requests: adaptive runs {adaptive.max_running} at once vs {full.max_running}, "
                     f"preempts {adaptive.preemptions} vs {full.preemptions} ({'met' if holds else 'missed'}); "
                     f"agreement {adaptive.agreement:.1%} vs int4's {int4.agreement:.1%} "
                     f"({'met' if better else 'missed'})")
    return lines


def main(model: str = "tiny-py", scale: float = 1.0) -> int:
    """Print the table and the verdict."""
    loads = sorted({max(2, round(n * scale)) for n in (2, 4, 8, 16)})
    results = measure(model, loads=loads, output_len=max(16, round(64 * scale)))
    print(f"[adaptive] {model}, every format in the same KV memory; agree: greedy tokens equal to an "
          "unconstrained full-precision run")
    print(format_table(results))
    for line in verdict(results):
        print("  " + line)
    return 0
