"""The course's chapters, in one place: the README's table and the tour's course map are both drawn from it
(``scripts/sync_course.py`` writes the README's; ``tests/test_notebook_hygiene.py`` checks that it and
``chapters/`` agree), so neither can drift from the chapters there are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Chapter:
    """One notebook of the course."""

    stem: str
    idea: str
    measured: str


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00_tour", "the finished engine at a glance",
            "generation on the bundled model, TTFT and TPOT, the course map"),
    Chapter("01_decoder_only", "a decode-only transformer from its pieces; sampling",
            "every piece checked against HF transformers; prefill and decode timed"),
    Chapter("02_prefill_decode", "two phases with opposite costs",
            "FLOPs and bytes per step, roofline (this CPU, H100, H200), TTFT vs prompt length, TPOT vs batch size"),
    Chapter("03_kv_cache", "why cache K and V (not Q); contiguous → paged; prefix reuse; the cache's lifecycle",
            "memory per token, fragmentation, block tables stepped through, prefix hit rate"),
    Chapter("03b_paged_attention_kernel", "the paged decode-attention kernel: naive, blocked, online softmax, Triton",
            "which blocks each program reads; the kernel checked against the reference"),
    Chapter("04_batching", "static, dynamic, continuous batching; chunked prefill; preemption",
            "scheduler timelines, throughput vs latency, a widget for the token budget and batch cap"),
    Chapter("05_pd_disaggregation",
            "prefill/decode interference; split workers; moving the KV cache; failures and snapshots",
            "TPOT spikes colocated vs chunked vs split, KV bytes per request, real models against real links, a "
            "worker killed live, the article's claims checked"),
    Chapter("05b_cluster_simulation",
            "from two processes to a GPU fleet: a simulator driving minipd's scheduler, goodput, placement",
            "the simulator against real runs (a live replay, this machine, an H200), SLO attainment vs rate, goodput "
            "per GPU by placement with DistServe's result checked, the best P:D ratio by workload, how much link "
            "hides the K/V transfer, where the split loses, the article's claimed gains tested, a cluster explorer "
            "widget"),
    Chapter("06_kv_compression",
            "quantized KV (int8, fp8, int4 per token and KIVI) and token eviction (presses); measuring quality "
            "honestly; precision that adapts to load",
            "K outlier channels, quantization error by grouping, the quality table (perplexity, KL, greedy "
            "agreement, copy probe), what each press keeps on real attention, a quality explorer widget, "
            "compressed PD transfer, adaptive precision under load, the article's 60–80% checked"),
    Chapter("07_moe",
            "mixture of experts: sparse activation, routing, load balance, capacity, expert parallelism, MLA",
            "dense vs sparse compute, expert load, balancing methods, all-to-all traffic and its overlap, "
            "quantized routing"),
    Chapter("08_serving", "the capstone: an OpenAI-compatible service under load",
            "the `openai` client against the engine, server-sent events, latency percentiles against the rate and "
            "the knee, continuous batching from the client, colocated vs disaggregated on the same cores, an int8 "
            "KV cache under memory pressure, a cancellation storm, the article's selection guide as numbers (with "
            "a widget)"),
)


def chapters_present() -> list[str]:
    """The chapters in the checkout this package was installed from (all of the course's when there is none)."""
    folder = Path(__file__).resolve().parent.parent / "chapters"
    found = [p.stem for p in sorted(folder.glob("[0-9]*.ipynb"))]
    return found or [ch.stem for ch in CHAPTERS]


def course_table(present: Iterable[str] | None = None, folder: str = "chapters") -> str:
    """The course as a markdown table; chapters in ``present`` (stems; by default :func:`chapters_present`) link
    to ``folder``, the others are marked as still to be written."""
    present = set(chapters_present() if present is None else present)
    rows = ["| chapter | the idea | what you measure or see |", "| --- | --- | --- |"]
    for ch in CHAPTERS:
        name = f"[{ch.stem}]({folder}/{ch.stem}.ipynb)" if ch.stem in present else f"{ch.stem} (to be written)"
        rows.append(f"| {name} | {ch.idea} | {ch.measured} |")
    return "\n".join(rows)


__all__ = ["CHAPTERS", "Chapter", "chapters_present", "course_table"]
