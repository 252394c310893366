"""The checks a snapshot's requests pass before any is admitted: every field of every request, its types and
ranges, its tokens in the vocabulary and within the model's context, its sampling parameters (rebuilt by
:class:`~minipd.sampling_params.SamplingParams` itself), its metrics and the log-probabilities it reported,
each as a run with those parameters and tokens would have them. A failure is a :class:`SnapshotError`
naming the request and the field. (The file format, its checksums and the K/V: :mod:`minipd.engine.snapshot`.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from minipd.outputs import RequestMetrics
from minipd.sampling_params import SamplingParams, check_seed, is_integer, is_real

if TYPE_CHECKING:
    from minipd.engine.core import EngineCore
    from minipd.engine.output_processor import OutputProcessor, RequestState


class Engine(Protocol):
    """What snapshots need of an engine (:class:`minipd.engine.engine.Engine`, which imports this module
    lazily: a protocol, so the two modules do not import each other)."""

    core: EngineCore
    processor: OutputProcessor
    max_model_len: int
    eos_token_ids: frozenset[int]

    def make_request(self, prompt: Any, params: SamplingParams, index: int = 0, request_id: str | None = None,
                     arrival_time: float | None = None, *, hold_kv: bool = False,
                     num_external_tokens: int = 0) -> RequestState: ...

    def add(self, state: RequestState, kv: Any = None) -> str: ...


#: SamplingParams fields saved (the private stop list is rebuilt from ``stop``).
PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
METRIC_FIELDS = {f.name for f in dataclasses.fields(RequestMetrics)}
ENTRY_FIELDS = {"index", "request_id", "prompt", "all_token_ids", "num_prompt_tokens", "params", "seed", "hold_kv",
                 "num_kv_tokens", "metrics", "logprobs", "prompt_logprobs", "num_prompt_logprobs_done",
                 "pending_prompt_logprobs"}


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded (corrupt, edited, partial, or made for another model or KV format),
    or a path a snapshot cannot be saved to."""


def check_entry(engine: Engine, entry: Any, where: str) -> dict[str, Any]:
    """Every field of one saved request, checked; returns them (with the rebuilt ``SamplingParams`` as
    ``sampling``). Raises :class:`SnapshotError` naming ``where`` (the file and the request's position), the
    request and the field."""

    def bad(field: str, what: str) -> SnapshotError:
        rid = entry.get("request_id") if isinstance(entry, dict) else None
        return SnapshotError(f"{where}{f' (request {rid!r})' if isinstance(rid, str) else ''}: {field} {what}")

    if not isinstance(entry, dict):
        raise SnapshotError(f"{where} is not an object")
    missing = sorted(ENTRY_FIELDS - set(entry))
    if missing:
        raise bad(missing[0], "is missing")
    unknown = sorted(set(entry) - ENTRY_FIELDS)
    if unknown:
        raise bad(unknown[0], "is not a snapshot field")
    vocab, max_len = engine.core.model.config.vocab_size, engine.max_model_len
    rid = entry["request_id"]
    if not isinstance(rid, str) or not rid:
        raise bad("request_id", f"must be a non-empty string, got {rid!r}")
    if rid in engine.processor.states or rid in engine.core.requests:
        raise bad("request_id", "is already running in this engine")
    if not is_integer(entry["index"]) or entry["index"] < 0:
        raise bad("index", f"must be an integer >= 0, got {entry['index']!r}")
    if entry["prompt"] is not None and not isinstance(entry["prompt"], str):
        raise bad("prompt", f"must be a string or null, got {type(entry['prompt']).__name__}")
    tokens = entry["all_token_ids"]
    if not isinstance(tokens, list) or not all(is_integer(t) and 0 <= t < vocab for t in tokens):
        raise bad("all_token_ids", f"must be a list of token ids in [0, {vocab})")
    if not 0 < len(tokens) < max_len:
        raise bad("all_token_ids", f"must hold 1 to {max_len - 1} tokens (the model's context), got {len(tokens)}")
    num_prompt = entry["num_prompt_tokens"]
    if not is_integer(num_prompt) or not 1 <= num_prompt <= len(tokens):
        raise bad("num_prompt_tokens", f"must be an integer in [1, {len(tokens)}], got {num_prompt!r}")
    sampling = _check_params(entry["params"], bad)
    outputs = tokens[num_prompt:]
    if len(outputs) >= sampling.max_tokens:
        raise bad("all_token_ids", f"holds {len(outputs)} output tokens, which a request with "
                                   f"max_tokens={sampling.max_tokens} would have finished")
    stops = set(sampling.stop_token_ids or ()) | (set() if sampling.ignore_eos else set(engine.eos_token_ids))
    ended = next((i for i, t in enumerate(outputs) if t in stops), None)
    if ended is not None:
        raise bad("all_token_ids", f"output token {ended} ({outputs[ended]}) is a stop token: the request would "
                                   "have finished")
    try:  # what admitting it checks: refused now, not after others were admitted
        engine.core.check_fits(len(tokens), sampling.max_tokens, what="it")
    except ValueError as err:
        raise bad("all_token_ids", f"cannot be resumed in this engine: {err}") from None
    try:
        seed = check_seed("seed", entry["seed"])
    except ValueError as err:
        raise bad("seed", f"is not valid: {err}") from None
    if seed is None:
        raise bad("seed", "must be the request's integer seed, got null")
    if not isinstance(entry["hold_kv"], bool):
        raise bad("hold_kv", f"must be true or false, got {entry['hold_kv']!r}")
    num_kv = entry["num_kv_tokens"]
    if not is_integer(num_kv) or not 0 <= num_kv < len(tokens):
        raise bad("num_kv_tokens", f"must be an integer in [0, {len(tokens) - 1}], got {num_kv!r}")
    _check_metrics(entry["metrics"], bad)
    _check_logprob_fields(entry, sampling, tokens[:num_prompt], outputs, vocab, bad)
    return {**entry, "seed": seed, "sampling": sampling}


def _check_params(params: Any, bad: Callable[[str, str], SnapshotError]) -> SamplingParams:
    """The saved sampling parameters, every field present and checked by :class:`SamplingParams` itself."""
    if not isinstance(params, dict):
        raise bad("params", "must be an object")
    missing = sorted(set(PARAM_FIELDS) - set(params))
    if missing:
        raise bad(f"params.{missing[0]}", "is missing")
    unknown = sorted(set(params) - set(PARAM_FIELDS))
    if unknown:
        raise bad(f"params.{unknown[0]}", "is not a sampling parameter (params is not a set of sampling parameters)")
    try:
        return SamplingParams(**params)
    except (ValueError, TypeError) as err:
        raise bad(f"params.{getattr(err, 'param', '')}".rstrip("."), f"is not valid: {err}") from None


def _check_metrics(metrics: Any, bad: Callable[[str, str], SnapshotError]) -> None:
    if not isinstance(metrics, dict):
        raise bad("metrics", "must be an object")
    for name, value in metrics.items():
        if name not in METRIC_FIELDS or name == "kv_timeline":
            raise bad(f"metrics.{name}", "is not a metric a snapshot keeps")
        if name == "token_times":
            ok = isinstance(value, list) and all(is_real(t) for t in value)
        elif name in ("prefill_tokens", "cached_tokens", "preemptions", "kv_transfer_bytes"):
            ok = is_integer(value) and value >= 0
        elif name in ("prefill_worker", "decode_worker"):
            ok = value is None or isinstance(value, str)
        elif name == "arrival_time":
            ok = is_real(value)
        else:
            ok = value is None or is_real(value)
        if not ok:
            raise bad(f"metrics.{name}", f"has a value of the wrong type or range: {value!r}")
    if "arrival_time" not in metrics:
        raise bad("metrics.arrival_time", "is missing")


def _check_logprob_fields(entry: dict[str, Any], sampling: SamplingParams, prompt: list[int], outputs: list[int],
                          vocab: int, bad: Callable[[str, str], SnapshotError]) -> None:
    """The log-probabilities saved, as a run with these parameters and tokens reports them."""
    k = sampling.logprobs
    if k is None or not outputs:  # reported with each output token, when asked for
        if entry["logprobs"] is not None:
            raise bad("logprobs", "must be null: " + ("none were asked for" if k is None else "no token was output"))
    else:
        _check_rows(entry["logprobs"], "logprobs", outputs, k, vocab, bad)
    k = sampling.prompt_logprobs
    done, pending, reported = (entry["num_prompt_logprobs_done"], entry["pending_prompt_logprobs"],
                               entry["prompt_logprobs"])
    if not is_integer(done) or not 1 <= done <= len(prompt) or (k is None and done != 1):
        raise bad("num_prompt_logprobs_done", f"must be an integer in [1, {len(prompt)}] (1 when prompt_logprobs "
                                              f"were not asked for), got {done!r}")
    if pending is None or (pending and (k is None or outputs)):  # (they go out with the first output token)
        raise bad("pending_prompt_logprobs", "must be an empty list " + (
            "when prompt_logprobs were not asked for" if k is None else "once a token was output"))
    if len(pending) > done - 1:
        raise bad("pending_prompt_logprobs", f"holds {len(pending)} positions but num_prompt_logprobs_done says "
                                             f"{done - 1} were scored")
    _check_rows(pending, "pending_prompt_logprobs", None, k or 0, vocab, bad)
    if k is None or not outputs:
        if reported is not None:
            raise bad("prompt_logprobs", "must be null: " + ("none were asked for" if k is None else
                                                             "they are reported with the first output token"))
        return
    if not isinstance(reported, list) or not reported or reported[0] is not None or len(reported) > len(prompt):
        raise bad("prompt_logprobs", f"must be a list of at most {len(prompt)} positions, the first null")
    # Complete (the usual case), position i scores prompt token i.
    _check_rows(reported[1:], "prompt_logprobs", prompt[1:] if len(reported) == len(prompt) else None, k, vocab, bad,
                first=1)


def _check_rows(table: Any, field: str, chosen: list[int] | None, k: int, vocab: int,
                bad: Callable[[str, str], SnapshotError], first: int = 0) -> None:
    """A list of positions (one per ``chosen`` token, if given), each 1 to ``k + 1`` ``[token id, logprob]``
    pairs, the chosen token first (as the model runner reports them); ``first``: the field's index of ``table[0]``."""
    if not isinstance(table, list) or (chosen is not None and len(table) != len(chosen)):
        raise bad(field, "must be a list" + (f" of {len(chosen)} positions" if chosen is not None else ""))
    for i, row in enumerate(table):
        if not isinstance(row, list) or not 1 <= len(row) <= k + 1 or not all(
                isinstance(pair, list) and len(pair) == 2 and is_integer(pair[0]) and 0 <= pair[0] < vocab
                and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)
                and (math.isfinite(pair[1]) or pair[1] == -math.inf) for pair in row):
            raise bad(f"{field}[{first + i}]", f"must hold 1 to {k + 1} [token id, log-probability] pairs")
        if chosen is not None and row[0][0] != chosen[i]:
            raise bad(f"{field}[{first + i}]", f"must score token {chosen[i]} first, got {row[0][0]}")


__all__ = ["ENTRY_FIELDS", "METRIC_FIELDS", "PARAM_FIELDS", "Engine", "SnapshotError", "check_entry"]
