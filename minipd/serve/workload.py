"""What a load test sends and when: seeded, repeatable schedules of (send time, prompt length, output length).

Arrivals are Poisson by default (exponential gaps at ``rate`` requests/s), or gamma-distributed gaps of
the same mean with shape ``burstiness`` (1 is Poisson; below 1 burstier, above 1 more regular: the gaps'
coefficient of variation is ``1 / sqrt(burstiness)``, as in vLLM's benchmark), or read from a JSONL trace
(``{"arrival": s, "prompt_len": n, "output_len": m}`` per line, or ``"prompt"`` text instead of a length).
Lengths are fixed, uniform in a range (``"64:256"``), normal or lognormal (``"normal:MEAN:STD"``,
``"lognormal:MEAN:SIGMA"``, each with an optional ``:MAX``; see :func:`draw_lengths`), or taken from the
trace. Prompts can also be real text from a prompts file (:func:`read_prompts`, :func:`prompts_workload`): one
per line, or JSONL with ``{"prompt": ...}``, chosen at random (seeded) or cycled through in file order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
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


#: The length distributions :func:`draw_lengths` knows besides fixed and uniform.
SHAPES = ("normal", "lognormal")


def draw_lengths(spec: str | int, n: int, rng: np.random.Generator, what: str = "lengths") -> np.ndarray:
    """``n`` lengths (integers >= 1) drawn with ``rng`` from ``spec``: ``N`` or ``LOW:HIGH`` (uniform, as
    :func:`parse_lengths`), ``normal:MEAN:STD`` or ``lognormal:MEAN:SIGMA`` (mean ``MEAN``; ``SIGMA`` the spread
    of the log, so the median is ``MEAN * exp(-SIGMA**2 / 2)``), rounded, at least 1 and at most ``MAX`` when the
    spec ends ``:MAX``."""
    text = str(spec)
    shape, _, rest = text.partition(":")
    if shape not in SHAPES:
        low, high = parse_lengths(spec, what)
        return rng.integers(low, high + 1, n)
    try:
        numbers = [float(x) for x in rest.split(":")]
        if len(numbers) not in (2, 3):
            raise ValueError
    except ValueError:
        raise ValueError(f"{what} must be {shape}:MEAN:SPREAD or {shape}:MEAN:SPREAD:MAX, got {spec!r}") from None
    mean, spread, top = numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else math.inf
    if not (mean > 0 and spread >= 0 and top >= 1) or not all(math.isfinite(x) for x in (mean, spread)):
        raise ValueError(f"{what}: {shape} needs MEAN > 0, a spread >= 0 and MAX >= 1, got {spec!r}")
    if shape == "normal":
        values = rng.normal(mean, spread, n)
    else:
        values = rng.lognormal(math.log(mean) - spread ** 2 / 2, spread, n)
    return np.clip(np.rint(values), 1, top).astype(np.int64)


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
    drawn from ``prompt_lens`` and ``output_lens`` (fixed, uniform, normal or lognormal: :func:`draw_lengths`)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    times = np.cumsum(arrival_gaps(num_requests, rate, burstiness, seed))
    rng = np.random.default_rng(seed + 1)  # lengths do not move when the rate does
    prompts = draw_lengths(prompt_lens, num_requests, rng, "prompt_lens")
    outputs = draw_lengths(output_lens, num_requests, rng, "output_lens")
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


def trace_rate(planned: Sequence[PlannedRequest]) -> float:
    """The average arrival rate of a schedule (requests/s over its span; inf when all arrive at once)."""
    span = max(r.send_at for r in planned) - min(r.send_at for r in planned) if planned else 0.0
    return (len(planned) - 1) / span if span > 0 else math.inf


def at_rate(planned: Sequence[PlannedRequest], rate: float) -> list[PlannedRequest]:
    """``planned`` with its send times scaled so that its average rate (:func:`trace_rate`) is ``rate``: a trace
    keeps its shape (bursts and lulls) at any load."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf sends everything at once), got {rate!r}")
    own = trace_rate(planned)
    if math.isinf(own) and not math.isinf(rate):
        raise ValueError("a trace whose requests all arrive at once has no rate to scale to "
                         f"{rate!r} requests/s")
    scale = 0.0 if math.isinf(rate) else own / rate
    start = min((r.send_at for r in planned), default=0.0)  # (a lead-in before the first request is dropped)
    return [replace(r, send_at=(r.send_at - start) * scale) for r in planned]


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: JSONL with ``{"prompt": "..."}`` per line (when its first line is such an
    object), else one prompt per line (blank lines skipped)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts")
    try:
        first = json.loads(lines[0])
    except ValueError:
        first = None
    if not (isinstance(first, dict) and "prompt" in first):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            prompt = json.loads(line)["prompt"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: prompt {number}: a JSONL prompts file needs {{\"prompt\": \"...\"}} on every "
                             f"line ({type(err).__name__}: {err})") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}: prompt {number}: the prompt must be a non-empty string, got {prompt!r}")
        prompts.append(prompt)
    return prompts


def prompts_workload(prompts: Sequence[str] | str | Path, num_requests: int, rate: float,
                     output_lens: str | int = 64, burstiness: float = 1.0, seed: int = 0,
                     order: str = "random") -> list[PlannedRequest]:
    """``num_requests`` requests with real prompt text (a list, or a file for :func:`read_prompts`) sent when
    :func:`synthetic_workload` would send them (same seed, same times), output lengths drawn from
    ``output_lens`` (see :func:`draw_lengths`). ``order``:
    ``"random"`` picks each prompt at random (seeded, with replacement), ``"cycle"`` takes them in order,
    starting over at the end. Each request's ``prompt_len`` is its text's length in characters (the server
    tokenizes the text; the report's token counts come from its ``usage``)."""
    texts = read_prompts(prompts) if isinstance(prompts, str | Path) else list(prompts)
    if not texts:
        raise ValueError("no prompts to send")
    if order not in ("random", "cycle"):
        raise ValueError(f"the prompts' order is random or cycle, got {order!r}")
    schedule = synthetic_workload(num_requests, rate, 1, output_lens, burstiness, seed)
    picks = (np.random.default_rng(seed + 2).integers(0, len(texts), num_requests) if order == "random"
             else np.arange(num_requests) % len(texts))
    return [replace(r, prompt_len=len(texts[i]), prompt=texts[i]) for r, i in zip(schedule, picks, strict=True)]


def prompt_ids(base: list[int], length: int, index: int, salt: int = 0) -> list[int]:
    """A prompt of ``length`` tokens drawn at random from ``base`` (the server's tokens of a text), seeded by
    ``(salt, index)``: the same pair gives the same prompt, any other pair one that shares no prefix block with
    it but by a negligible chance (like vLLM's random dataset). Cutting prompts out of the text instead would
    repeat its period: a run's prompts, and every later run's, would share prefixes a prefix cache serves."""
    if not base:
        raise ValueError("no tokens to build prompts from")
    if length < 0:
        raise ValueError(f"a prompt's length is at least 0, got {length}")
    rng = np.random.default_rng([salt & 0xFFFF_FFFF_FFFF_FFFF, index])
    return [base[i] for i in rng.integers(0, len(base), length)]


__all__ = ["SHAPES", "PlannedRequest", "arrival_gaps", "at_rate", "draw_lengths", "parse_lengths", "prompt_ids",
           "prompts_workload", "read_prompts", "synthetic_workload", "trace_rate", "trace_workload"]
