"""What a load test sends and when: seeded, repeatable schedules of (send time, prompt length, output length).

Arrivals are Poisson by default (exponential gaps at ``rate`` requests/s), or gamma-distributed gaps of
the same mean with shape ``burstiness`` (1 is Poisson; below 1 burstier, above 1 more regular: the gaps'
coefficient of variation is ``1 / sqrt(burstiness)``, as in vLLM's benchmark), or read from a JSONL trace
(``{"arrival": s, "prompt_len": n, "output_len": m}`` per line, or ``"prompt"`` text instead of a length).
Lengths are fixed, uniform in a range (``"64:256"``), or taken from the trace.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a load test: when to send it (seconds from the start) and how long it is."""

    send_at: float
    prompt_len: int
    output_len: int
    #: Text to send instead of ``prompt_len`` synthetic tokens (from a trace or prompts file).
    prompt: str | None = None


def parse_lengths(spec: str | int, what: str) -> tuple[int, int]:
    """``"128"`` or ``128`` (fixed) or ``"64:256"`` (uniform, both ends included) as (low, high)."""
    text = str(spec)
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise ValueError(f"{what} must be N or LOW:HIGH (positive integers), got {spec!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{what} must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {spec!r}")
    return bounds


def arrival_gaps(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gaps (seconds) before each request: gamma with shape ``burstiness`` and mean ``1 / rate`` (exponential,
    i.e. Poisson arrivals, at burstiness 1); all zero at ``rate=inf`` (everything at once)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf sends everything at once), got {rate!r}")
    if not burstiness > 0 or not math.isfinite(burstiness):
        raise ValueError(f"burstiness must be a positive number, got {burstiness!r}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)


def synthetic_workload(num_requests: int, rate: float, prompt_lens: str | int = 128, output_lens: str | int = 64,
                       burstiness: float = 1.0, seed: int = 0) -> list[PlannedRequest]:
    """``num_requests`` requests arriving at ``rate`` (gamma gaps of shape ``burstiness``), with lengths
    drawn uniformly from ``prompt_lens`` and ``output_lens`` (see :func:`parse_lengths`)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    (p_lo, p_hi), (o_lo, o_hi) = parse_lengths(prompt_lens, "prompt_lens"), parse_lengths(output_lens, "output_lens")
    times = np.cumsum(arrival_gaps(num_requests, rate, burstiness, seed))
    rng = np.random.default_rng(seed + 1)  # lengths do not move when the rate does
    prompts, outputs = rng.integers(p_lo, p_hi + 1, num_requests), rng.integers(o_lo, o_hi + 1, num_requests)
    start = times[0] if len(times) else 0.0  # the first request goes at once
    return [PlannedRequest(float(t - start), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)]


def trace_workload(path: str | Path, time_scale: float = 1.0) -> list[PlannedRequest]:
    """The requests of a JSONL trace, in arrival order; ``time_scale`` < 1 replays it faster."""
    planned = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row.get("prompt")
            prompt_len = len(prompt) if isinstance(prompt, str) else int(row["prompt_len"])
            item = PlannedRequest(float(row.get("arrival", 0.0)) * time_scale, prompt_len, int(row["output_len"]),
                                  prompt if isinstance(prompt, str) else None)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}:{number}: a trace line needs arrival (s), output_len and prompt_len or "
                             f"prompt ({type(err).__name__}: {err})") from None
        if item.output_len < 1 or item.prompt_len < 1 or item.send_at < 0:
            raise ValueError(f"{path}:{number}: lengths must be >= 1 and arrival >= 0")
        planned.append(item)
    if not planned:
        raise ValueError(f"{path} holds no requests")
    return sorted(planned, key=lambda r: r.send_at)


def prompt_ids(base: list[int], length: int, index: int) -> list[int]:
    """A prompt of ``length`` tokens cut from ``base`` (the server's tokens of a text), starting at a place that
    depends on ``index``, so requests differ (and share prefixes only by chance)."""
    if not base:
        raise ValueError("no tokens to build prompts from")
    start = (index * 7919) % len(base)
    return [base[(start + i) % len(base)] for i in range(length)]


__all__ = ["PlannedRequest", "arrival_gaps", "parse_lengths", "prompt_ids", "synthetic_workload", "trace_workload"]
