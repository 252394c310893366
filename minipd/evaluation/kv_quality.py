"""What a compressed KV cache costs in quality, measured against the full-precision cache.

Every figure compares one engine configuration (a ``kv_cache_dtype``, say) with the reference (the
model's own dtype) on held-out text the bundled models never saw (``assets/text/heldout_code.txt``):

- **perplexity** of the text, and its change: each token is scored by logits computed from the
  compressed cache. In minipd a prompt's queries read their K/V back from the pool (prefill and
  decode alike), so scoring a prompt in one pass is decode mode for a quantized cache; an evicting
  cache (``"sink-window:64"``: a press and a budget) is fed one token per step, so every token
  reads what the press kept by then;
- **KL divergence** of the next-token distributions, reference → compressed, averaged over tokens
  (the full distributions, not their top entries);
- **greedy agreement**: from held-out prompts, how many generated tokens match the reference
  before the first difference, and the fraction equal position by position;
- **copy probe**: how much an identifier defined earlier in the context raises the probability of
  its later use (nats, against the same text with the definition renamed). A cache that drops the
  definition loses this; the bundled models copy only over short spans, so the probe is short.

``python -m minipd kvquality`` prints the table; :func:`measure` returns it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minipd.sampling_params import SamplingParams

#: Identifiers the copy probe defines early and uses later (made up, so no model has seen them together).
PROBE_NAMES = ("tally_crimson_ledgers", "rebuild_quartz_index", "scan_velvet_manifest", "prune_amber_queue",
               "fold_cobalt_totals", "stitch_maple_records", "weigh_onyx_parcels", "sort_juniper_slots")


def heldout_text() -> str:
    """The held-out Python text the measurements run on."""
    return (Path(__file__).resolve().parents[2] / "assets" / "text" / "heldout_code.txt").read_text()


@dataclass
class QualityReport:
    """One configuration's cost and quality against the reference."""

    method: str
    bytes_per_token: float
    #: KV bytes per token over an fp16 cache's (scales included).
    bytes_vs_fp16: float
    perplexity: float
    #: Relative change of perplexity against the reference (0.01 is 1% worse).
    perplexity_change: float
    mean_kl: float
    #: Mean generated tokens equal to the reference's before the first difference, and the share equal.
    greedy_prefix: float
    greedy_equal: float
    #: Mean nats the earlier definition adds to an identifier's later use.
    copy_gain: float
    #: Share of a window's tokens whose K/V are kept (1 without eviction); bytes_vs_fp16 counts it.
    kept: float = 1.0


def method_options(method: str) -> dict[str, Any]:
    """Engine options for a method name: a ``kv_cache_dtype`` (``"int8"``), or a press and a token budget
    (``"sink-window:64"``; ``"sink-window:64@token"`` to rank single tokens), optionally after a dtype
    (``"int8+knorm:64"``). ``"weights-int8"`` asks for int8 weights (``weight_dtype``), not a cache format;
    ``"model-bf16"`` runs the whole model in bfloat16 (weights, activations and its cache: ``dtype``)."""
    options: dict[str, Any] = {}
    for part in method.split("+"):
        if part == "weights-int8":
            options["weight_dtype"] = "int8"
        elif part == "model-bf16":
            options["dtype"] = "bfloat16"
        elif ":" in part:
            press, budget = part.split(":", 1)
            budget, _, granularity = budget.partition("@")
            if not budget.isdigit() or granularity not in ("", "block", "token"):
                raise ValueError(f"a method's budget must be a number of tokens, optionally followed by @token or "
                                 f"@block, got {part!r}")
            # One token per step: decode mode, so eviction happens as the text streams in.
            options |= {"kv_eviction": press, "kv_budget": int(budget), "max_num_batched_tokens": 1,
                        "kv_eviction_granularity": granularity or "block"}
        elif part != "auto":
            options["kv_cache_dtype"] = part
    return options


def _llm(model: str, options: dict[str, Any]):
    from minipd import LLM

    return LLM(model, **{"enable_prefix_caching": False, **options})


def next_token_logprobs(llm: Any, ids: Sequence[int]) -> torch.Tensor:
    """(len(ids), V) log-probabilities: row i is the distribution after ``ids[:i + 1]``, computed by ``llm``
    from its own (possibly compressed) cache. Captured at the LM head, so the full distribution."""
    rows: list[torch.Tensor] = []
    handle = llm.model.lm_head.register_forward_hook(lambda module, args, out: rows.append(out.detach().float()))
    try:
        llm.generate([list(ids)], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        handle.remove()
    table = torch.cat(rows)  # the prompt's rows chunk by chunk, then the sampled row
    if table.shape[0] != len(ids):
        raise RuntimeError(f"captured {table.shape[0]} rows of logits for {len(ids)} tokens")
    return table.log_softmax(dim=-1)


def windows(tokenizer: Any, length: int, count: int) -> list[list[int]]:
    """``count`` consecutive windows of ``length`` tokens of the held-out text (fewer if it is short)."""
    ids = tokenizer.encode(heldout_text())
    return [ids[i * length:(i + 1) * length] for i in range(min(count, len(ids) // length))]


def copy_probe(tokenizer: Any, filler_tokens: int = 60,
               preamble_tokens: int = 40) -> list[tuple[list[int], list[int], tuple[int, int, int]]]:
    """For each probe name: the text with the definition, the same with it renamed, and the span of
    the later use's tokens after its first word (what copying predicts), with the token shift between
    the two texts. A preamble comes first, so the definition is not among the very first tokens
    (which sink-window eviction keeps whatever they say)."""
    filler_ids = tokenizer.encode(heldout_text())
    probes = []
    for i, name in enumerate(PROBE_NAMES):
        filler = tokenizer.decode(filler_ids[400 + 97 * i:400 + 97 * i + filler_tokens])
        preamble = tokenizer.decode(filler_ids[1200 + 61 * i:1200 + 61 * i + preamble_tokens]) + "\n\n\n"
        head, other = f"{preamble}def {name}(rows):\n", f"{preamble}def unrelated(rows):\n"
        body = "    return [row for row in rows if row]\n\n\n" + filler + "\n\n\nresult = "
        first = name.split("_")[0] + "_"
        start = len(tokenizer.encode(head + body + first))
        end = len(tokenizer.encode(head + body + name))
        use = f"{name}(rows)\n"
        with_def, without = tokenizer.encode(head + body + use), tokenizer.encode(other + body + use)
        shift = len(without) - len(with_def)  # the renamed definition may tokenize to another length
        probes.append((with_def, without, (start, end, shift)))
    return probes


def _copy_gain(llm: Any, probes: list) -> float:
    gains = []
    for with_def, without, (start, end, shift) in probes:
        a, b = next_token_logprobs(llm, with_def), next_token_logprobs(llm, without)
        got = sum(a[j - 1, with_def[j]].item() for j in range(start, end))
        base = sum(b[j - 1 + shift, without[j + shift]].item() for j in range(start, end))
        gains.append(got - base)
    return sum(gains) / len(gains)


def measure(model: str = "tiny-py", methods: Sequence[str] = ("fp16", "fp8", "int8"), window: int = 256,
            num_windows: int = 6, greedy_prompts: int = 4, greedy_tokens: int = 128, num_probes: int = len(PROBE_NAMES),
            options: dict[str, dict[str, Any]] | None = None, progress: bool = True) -> list[QualityReport]:
    """The quality table: the reference (``"auto"``) first, then each method.

    Args:
        methods: names :func:`method_options` understands, or keys of ``options``.
        window, num_windows: held-out text scored, in windows of this many tokens.
        greedy_prompts, greedy_tokens: greedy generations compared (64-token held-out prompts).
        num_probes: copy probes run (at most ``len(PROBE_NAMES)``).
        options: engine options per method name, for methods that are not a ``kv_cache_dtype``.
    """
    from tqdm.auto import tqdm

    options = options or {}
    configs = {"auto": {}} | {m: options.get(m) or method_options(m) for m in methods}
    reference = None
    reports = []
    for name, config in tqdm(configs.items(), desc="kv quality", disable=not progress):
        llm = _llm(model, config)
        texts = windows(llm.tokenizer, window, num_windows)
        tables = [next_token_logprobs(llm, ids) for ids in texts]
        prompts = [ids[:64] for ids in windows(llm.tokenizer, 64 + greedy_tokens, greedy_prompts)]
        greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=greedy_tokens,
                                                                           ignore_eos=True), use_tqdm=False)]
        nll = torch.cat([-t[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
                         for t, ids in zip(tables, texts, strict=True)])
        copy = _copy_gain(llm, copy_probe(llm.tokenizer)[:max(1, num_probes)])
        spec = llm.engine.core.kv_spec
        fp16 = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
        budget = llm.engine.config.kv_budget
        kept = 1.0 if budget is None else min(1.0, (budget + spec.block_size) / window)
        if reference is None:
            reference = {"tables": tables, "ppl": math.exp(nll.mean().item()), "greedy": greedy}
        kl = torch.cat([(r.exp() * (r - t)).sum(-1) for r, t in zip(reference["tables"], tables, strict=True)])
        prefix, equal, total = [], 0, 0
        for mine, ref in zip(greedy, reference["greedy"], strict=True):
            same = [a == b for a, b in zip(mine, ref, strict=True)]
            prefix.append(same.index(False) if False in same else len(same))
            equal, total = equal + sum(same), total + len(same)
        ppl = math.exp(nll.mean().item())
        reports.append(QualityReport(name, spec.bytes_per_token * kept, spec.bytes_per_token * kept / fp16, ppl,
                                     ppl / reference["ppl"] - 1, kl.mean().item(), sum(prefix) / len(prefix),
                                     equal / total, copy, kept))
    return reports


def format_table(reports: Sequence[QualityReport]) -> str:
    """The reports as the fixed-width table the CLI prints."""
    width = max(12, *(len(r.method) for r in reports))
    head = (f"{'method':>{width}} {'B/token':>8} {'vs fp16':>8} {'ppl':>8} {'Δppl':>8} {'KL':>9} "
            f"{'greedy=':>8} {'equal':>6} {'copy':>6}")
    rows = [head]
    for r in reports:
        rows.append(f"{r.method:>{width}} {r.bytes_per_token:8.0f} {r.bytes_vs_fp16:7.3f}x {r.perplexity:8.3f} "
                    f"{r.perplexity_change:+7.2%} {r.mean_kl:9.2e} {r.greedy_prefix:8.1f} {r.greedy_equal:6.1%} "
                    f"{r.copy_gain:6.2f}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m minipd kvquality``: print the quality table for the chosen cache formats."""
    from minipd.engine.config import EngineConfig
    from minipd.kv.spec import KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(prog="python -m minipd kvquality", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-py")
    parser.add_argument("--methods", nargs="+", default=["fp16", "fp8", "int8"],
                        help=f"kv_cache_dtype values ({', '.join(d for d in KV_CACHE_DTYPES if d != 'auto')}), "
                             "presses with a token budget (sink-window:64, knorm:64, random:64), or both "
                             "(int8+sink-window:64); weights-int8 for int8 weights instead of a cache format, "
                             "model-bf16 for the whole model in bfloat16")
    parser.add_argument("--windows", type=int, default=6, help="256-token held-out windows scored (>= 1)")
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error("--windows must be at least 1")
    for method in args.methods:
        try:
            EngineConfig(**{k: v for k, v in method_options(method).items() if k != "dtype"})
        except ValueError as err:
            parser.error(f"method {method!r}: {err}")
    reports = measure(args.model, args.methods, num_windows=args.windows)
    print(f"[kvquality] {args.model}, held-out text, reference = the model's dtype ('auto')")
    print(format_table(reports))
    print("  B/token: KV bytes per token of a 256-token window (scales included; an evicting cache keeps its budget")
    print("  and up to a block more); vs fp16: over an fp16 cache's; Δppl: perplexity change; KL: mean")
    print("  KL(reference || method) per token; greedy=: tokens equal before the first difference (of 128); equal:")
    print("  share of equal tokens; copy: nats an early definition adds to an identifier's later use.")
    return 0
