"""Resumable snapshots (断点续传): every unfinished request and its K/V, saved to disk and loaded again.

A snapshot is a folder with two files:

- ``manifest.json``: the format and its version, the model's shape, the :class:`~minipd.kv.spec.KVSpec`,
  and per request its tokens, sampling parameters, seed (with the token index, all the RNG state
  sampling needs), metrics, the log-probabilities reported so far, and how many tokens of K/V were
  saved; the SHA-256 of ``kv.safetensors``, and the SHA-256 of the manifest itself;
- ``kv.safetensors``: per request, one packed ``(2, blocks, block_size, kv_heads, head_dim)`` tensor
  per layer, named ``{request index}.{layer}``.

Loading trusts nothing it reads: format, version, both checksums, the model, the KV format, every
field of every request (types, ranges, token ids in the vocabulary, unique request ids, ids not
already running), every tensor's shape — all before admitting anything, so a corrupt, edited,
partial or mismatched snapshot is refused with a :class:`SnapshotError` naming the request and the
field, and the engine is left as it was.

The checksums find corruption and careless edits, not forgery: anyone can recompute them, so a
snapshot is as trustworthy as the folder it was read from (its K/V are admitted as computed for its
tokens, and join the prefix cache under them).

Saving never destroys what it did not write: a path that exists and is not a minipd snapshot (a
file, a folder of yours, a link, a snapshot folder holding anything but its two plain files) is
refused and left alone. A snapshot is written to a staging folder beside its place, flushed to disk
(files and folders), and swapped in by renames — the old one aside, the new one in, the old one put
back if that fails — so a crash leaves the previous snapshot whole; the old one is then removed file
by file (only the files a snapshot has, never a folder with anything else in it).

Version 1 snapshots (no manifest checksum, no log-probabilities) are refused with that reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from minipd.kv.paged_pool import PackedKV
from minipd.kv.spec import KVSpec
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

FORMAT = "minipd-snapshot"
#: 2: the manifest is checksummed and carries log-probabilities (version 1 is refused: it had no checksum).
VERSION = 2
MANIFEST = "manifest.json"
KV_FILE = "kv.safetensors"
#: Every file a snapshot folder holds: nothing else is ever removed when one is replaced.
SNAPSHOT_FILES = (MANIFEST, KV_FILE)

#: SamplingParams fields saved (the private stop list is rebuilt from ``stop``).
_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
_METRIC_FIELDS = {f.name for f in dataclasses.fields(RequestMetrics)}
_ENTRY_FIELDS = {"index", "request_id", "prompt", "all_token_ids", "num_prompt_tokens", "params", "seed", "hold_kv",
                 "num_kv_tokens", "metrics", "logprobs", "prompt_logprobs", "num_prompt_logprobs_done",
                 "pending_prompt_logprobs"}


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded (corrupt, edited, partial, or made for another model or KV format),
    or a path a snapshot cannot be saved to."""


def model_fingerprint(engine: Engine) -> dict[str, Any]:
    """What a snapshot's K/V depend on: the model's shape (weights are not hashed: they are the user's call)."""
    cfg = engine.core.model.config
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "max_model_len": engine.max_model_len}


def _logprobs_to_json(table: list[dict[int, float] | None] | None) -> list | None:
    """Log-probabilities as JSON can hold them: each position a list of ``[token, logprob]`` (or None)."""
    if table is None:
        return None
    return [None if row is None else [[int(t), float(lp)] for t, lp in row.items()] for row in table]


def _logprobs_from_json(table: list | None) -> list[dict[int, float] | None] | None:
    if table is None:
        return None
    return [None if row is None else {t: lp for t, lp in row} for row in table]


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON, its own checksum field left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_snapshot(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder minipd wrote as a snapshot: a real folder (not a link) holding our
    manifest and nothing but a snapshot's plain files — the only kind :func:`save_snapshot` replaces."""
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        for child in path.iterdir():
            # Anything else (a file of yours, a folder, a link) would be lost or followed on replacing it.
            if child.name not in SNAPSHOT_FILES or child.is_symlink() or not child.is_file():
                return False
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def save_snapshot(engine: Engine, path: str | os.PathLike) -> Path:
    """Write every unfinished request of ``engine`` and its computed K/V to the folder ``path``.

    ``path`` must not exist, or be a snapshot minipd wrote (which is replaced whole); anything else is
    refused with :class:`SnapshotError` and left as it is. So is a save while a failed step's outputs
    still wait to be applied (call ``step`` again first).
    """
    from safetensors.torch import save_file

    path = Path(path)
    if (path.is_symlink() or path.exists()) and not is_snapshot(path):
        raise SnapshotError(f"{path} exists and is not a minipd snapshot; it was left alone: save the snapshot "
                            "to a new path (or to a snapshot folder minipd wrote, which is replaced)")
    if engine.processor.has_pending():
        # The core has tokens the front end has not applied yet: their text, times and logprobs would be lost.
        raise SnapshotError("outputs of a failed step still wait to be applied: call step() again, then save")
    entries, tensors = [], {}
    for index, state in enumerate(engine.processor.states.values()):
        request = state.request
        if request is None:
            continue
        core_request = engine.core.requests.get(request.request_id)
        num_kv = 0
        # K/V of evicting or adaptive pools are not saved: those requests are recomputed on resume.
        if core_request is not None and core_request.num_computed_tokens and engine.core.compressed_spec is None \
                and not core_request.blocks.num_dropped_tokens and core_request.blocks.block_table:
            num_kv = core_request.num_computed_tokens
            packed = engine.core.export_kv(request.request_id, num_kv)
            for layer, kv in enumerate(packed.layers):
                tensors[f"{index}.{layer}"] = kv.contiguous().cpu()
            for layer, (k_scales, v_scales) in enumerate(packed.scales or ()):  # codes need their scales
                tensors[f"{index}.{layer}.k_scales"] = k_scales.contiguous().cpu()
                tensors[f"{index}.{layer}.v_scales"] = v_scales.contiguous().cpu()
            if packed.tail is not None:  # a KIVI tail, exactly as its residual window holds it
                tensors[f"{index}.tail"] = packed.tail.contiguous().cpu()
        metrics = {f: getattr(state.metrics, f) for f in _METRIC_FIELDS if f != "kv_timeline"}
        entries.append({
            "index": index, "request_id": state.request_id, "prompt": state.prompt,
            "all_token_ids": list(request.all_token_ids), "num_prompt_tokens": request.num_prompt_tokens,
            "params": {name: getattr(state.params, name) for name in _PARAM_FIELDS},
            "seed": request.seed, "hold_kv": request.hold_kv, "num_kv_tokens": num_kv, "metrics": metrics,
            # What was reported so far, and the prompt's scores computed but not reported yet.
            "logprobs": _logprobs_to_json(state.logprobs),
            "prompt_logprobs": _logprobs_to_json(state.prompt_logprobs),
            "num_prompt_logprobs_done": request.num_prompt_logprobs_done,
            "pending_prompt_logprobs": _logprobs_to_json(request.pending_prompt_logprobs),
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh folder of our own beside the target (same file system, so the renames below are atomic).
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        kv_path = staging / KV_FILE
        save_file(tensors, str(kv_path), metadata={"format": FORMAT})
        manifest = {"format": FORMAT, "version": VERSION, "model": model_fingerprint(engine),
                    "kv_spec": engine.core.kv_spec.to_dict(), "kv_sha256": _sha256(kv_path), "requests": entries}
        manifest["manifest_sha256"] = manifest_checksum(manifest)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for name in SNAPSHOT_FILES:
            _fsync(staging / name)
        _fsync(staging)
        _swap_in(staging, path)
    finally:
        if staging.is_dir() and not staging.is_symlink():  # still there: the swap did not happen
            _remove_snapshot(staging)
    return path


def _swap_in(staging: Path, path: Path) -> None:
    """Put the finished snapshot ``staging`` at ``path``, replacing the snapshot there (if any) by renames.

    At every moment ``path`` is the old snapshot, nothing, or the new one; a failed rename puts the old
    one back. Only then is the old one removed, file by file.
    """
    old = None
    if path.exists() or path.is_symlink():
        if not is_snapshot(path):  # it changed since save_snapshot looked: still not ours to replace
            raise SnapshotError(f"{path} exists and is not a minipd snapshot; it was left alone")
        old = path.with_name(f".{path.name}.old-{secrets.token_hex(4)}")
        path.rename(old)
    try:
        staging.rename(path)
    except BaseException:
        if old is not None:
            old.rename(path)
        raise
    _fsync(path.parent)
    if old is not None:
        try:
            _remove_snapshot(old)
        except OSError as err:  # the new snapshot is in place: a stale copy left beside it is not worth failing
            warnings.warn(f"the previous snapshot was kept at {old}: it could not be removed ({err})",
                          RuntimeWarning, stacklevel=3)


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to disk."""
    if os.name == "nt" and path.is_dir():
        return  # Windows cannot open a folder to flush it (its renames are journaled by NTFS)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_snapshot(folder: Path) -> None:
    """Remove a folder this module wrote: its snapshot files, then the folder (never anything else in it)."""
    for name in SNAPSHOT_FILES:
        file = folder / name
        if file.is_symlink() or file.is_file():  # (a link itself is removed, never what it points to)
            file.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # something else is in it: not ours to delete
        pass


def load_snapshot(engine: Engine, path: str | os.PathLike) -> list[str]:
    """Re-admit the requests saved in ``path`` into ``engine`` (same model and KV format); return their ids.

    All or nothing: every field of every request, and its K/V, is checked (and each request rebuilt)
    before any is admitted; on any problem, :class:`SnapshotError` naming the request and the field,
    and the engine is as it was.
    """
    path = Path(path)
    try:
        manifest = _read_manifest(path)
        _check_compatible(engine, manifest, path)
        checked = [_check_entry(engine, i, entry, path) for i, entry in enumerate(manifest["requests"])]
    except RecursionError:  # (a value nested so deep that hashing or quoting it overflows the stack)
        raise SnapshotError(f"{path / MANIFEST} nests values too deeply: the snapshot is corrupt") from None
    for field in ("request_id", "index"):
        first_at: dict[Any, int] = {}
        for position, entry in enumerate(checked):
            earlier = first_at.setdefault(entry[field], position)
            if earlier != position:
                raise SnapshotError(f"{path / MANIFEST}: requests[{position}] (request {entry['request_id']!r}): "
                                    f"{field} {entry[field]!r} appears more than once (also requests[{earlier}])")
    packed = _read_kv(path, manifest["kv_sha256"], checked, engine.core.kv_spec)
    states = []
    for position, entry in enumerate(checked):
        where = f"{path / MANIFEST}: requests[{position}] (request {entry['request_id']!r})"
        try:
            state = engine.make_request(entry["all_token_ids"][:entry["num_prompt_tokens"]], entry["sampling"],
                                        request_id=entry["request_id"], hold_kv=entry["hold_kv"],
                                        num_external_tokens=entry["num_kv_tokens"])
            request = state.request
            request.all_token_ids[:] = entry["all_token_ids"]
            request.seed = entry["seed"]
            request.num_prompt_logprobs_done = entry["num_prompt_logprobs_done"]
            request.pending_prompt_logprobs = _logprobs_from_json(entry["pending_prompt_logprobs"]) or []
            state.prompt = entry["prompt"]
            state.metrics = RequestMetrics(**entry["metrics"])
            # Text rebuilt here, before anything is admitted: the request must still be running after it.
            engine.processor.replay(state, request.output_token_ids)
        except (ValueError, TypeError) as err:
            raise SnapshotError(f"{where} cannot be restored: {err}") from None
        if state.finished:
            raise SnapshotError(f"{where}: all_token_ids hold a stop string ({state.stop_reason!r}): the request "
                                "would have finished")
        state.logprobs = _logprobs_from_json(entry["logprobs"])
        state.prompt_logprobs = _logprobs_from_json(entry["prompt_logprobs"])
        states.append((state, packed.get(entry["index"])))
    added: list[str] = []
    try:
        for state, kv in states:
            added.append(engine.add(state, kv=kv))
    except Exception as err:  # checked above, so not expected: take back what was added, as if never there
        for request_id in added:
            engine.core.abort_requests([request_id])
            engine.processor.counters.prompt_tokens -= len(engine.processor.states.pop(request_id).prompt_token_ids)
        raise SnapshotError(f"{path}: a request could not be admitted ({type(err).__name__}: {err}); none was") \
            from err
    return added


def _check_entry(engine: Engine, position: int, entry: Any, path: Path) -> dict[str, Any]:
    """Every field of one saved request, checked; returns them (with the rebuilt ``SamplingParams`` as
    ``sampling``). Raises :class:`SnapshotError` naming the request and the field."""
    where = f"{path / MANIFEST}: requests[{position}]"

    def bad(field: str, what: str) -> SnapshotError:
        rid = entry.get("request_id") if isinstance(entry, dict) else None
        return SnapshotError(f"{where}{f' (request {rid!r})' if isinstance(rid, str) else ''}: {field} {what}")

    if not isinstance(entry, dict):
        raise SnapshotError(f"{where} is not an object")
    missing = sorted(_ENTRY_FIELDS - set(entry))
    if missing:
        raise bad(missing[0], "is missing")
    unknown = sorted(set(entry) - _ENTRY_FIELDS)
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
    missing = sorted(set(_PARAM_FIELDS) - set(params))
    if missing:
        raise bad(f"params.{missing[0]}", "is missing")
    unknown = sorted(set(params) - set(_PARAM_FIELDS))
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
        if name not in _METRIC_FIELDS or name == "kv_timeline":
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise SnapshotError(f"no snapshot at {path}: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except OSError as err:
        raise SnapshotError(f"{manifest_path} cannot be read: {err}") from None
    except (ValueError, RecursionError) as err:  # (not JSON, not UTF-8, or nested past what a parser takes)
        raise SnapshotError(f"{manifest_path} is not valid JSON ({err}): the snapshot is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{manifest_path} is not a minipd snapshot")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"{manifest_path} is snapshot version {manifest.get('version')!r}; this minipd reads "
                            f"version {VERSION}" + (" (version 1 manifests had no checksum: take the snapshot again)"
                                                    if manifest.get("version") == 1 else ""))
    if manifest.get("manifest_sha256") != manifest_checksum(manifest):
        raise SnapshotError(f"{manifest_path} does not match its own checksum: it was edited or corrupted after "
                            "it was written")
    for field, kind, what in (("model", dict, "an object"), ("kv_spec", dict, "an object"),
                              ("kv_sha256", str, "a string"), ("requests", list, "a list")):
        if not isinstance(manifest.get(field), kind):
            raise SnapshotError(f"{manifest_path}: {field} is missing or not {what}: the snapshot is corrupt")
    return manifest


def _check_compatible(engine: Engine, manifest: dict[str, Any], path: Path) -> None:
    for field, ours, what in (("model", model_fingerprint(engine), "was taken with another model"),
                              ("kv_spec", engine.core.kv_spec.to_dict(), "stores K/V in another format")):
        theirs = manifest[field]
        # Keys on either side: a key only the snapshot has (say ``latent``) is a difference too.
        differ = [f"{k} {theirs.get(k)!r} (here {ours.get(k)!r})" for k in [*ours, *(set(theirs) - set(ours))]
                  if theirs.get(k) != ours.get(k)]
        if differ:
            raise SnapshotError(f"{path} {what}: {', '.join(differ)}")


def _read_kv(path: Path, kv_sha256: str, entries: list[dict[str, Any]], spec: KVSpec) -> dict[int, PackedKV]:
    """The K/V of every (checked) request that saved some, by index; every tensor's shape and dtype checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    kv_path = path / KV_FILE
    if not kv_path.is_file():
        raise SnapshotError(f"{kv_path} is missing: the snapshot is partial")
    if _sha256(kv_path) != kv_sha256:
        raise SnapshotError(f"{kv_path} does not match the checksum in its manifest: the snapshot is corrupt "
                            "or partly written")
    try:
        tensors = load_file(str(kv_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise SnapshotError(f"{kv_path} cannot be read: {err}") from None
    packed = {}
    for position, entry in enumerate(entries):
        num_tokens = entry["num_kv_tokens"]
        if not num_tokens:
            continue
        who = f"{kv_path}: the K/V of requests[{position}] (request {entry['request_id']!r}, {num_tokens} tokens)"
        blocks = -(-num_tokens // spec.block_size)
        shape = (2, blocks, *spec.block_shape)
        layers, scales = [], []
        for layer in range(spec.num_layers):
            tensor = tensors.get(f"{entry['index']}.{layer}")
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != spec.dtype:
                raise SnapshotError(f"{who}, layer {layer}, are missing or not {shape} {spec.dtype}")
            layers.append(tensor)
            if spec.is_quantized:
                pair = []
                for name, per_block in (("k_scales", spec.key_scale_shape), ("v_scales", spec.scale_shape)):
                    tensor = tensors.get(f"{entry['index']}.{layer}.{name}")
                    expected = (blocks, *per_block)
                    if tensor is None or tuple(tensor.shape) != expected or tensor.dtype != spec.scale_dtype:
                        raise SnapshotError(f"{who}, layer {layer}: the {name[0].upper()} scales are missing "
                                            f"or not {expected} {spec.scale_dtype}")
                    pair.append(tensor)
                scales.append((pair[0], pair[1]))
        tail = tensors.get(f"{entry['index']}.tail")
        filled = num_tokens % spec.block_size
        expected = (2, spec.num_layers, filled, spec.num_kv_heads, spec.head_dim)
        if tail is not None and (tuple(tail.shape) != expected or not tail.dtype.is_floating_point):
            raise SnapshotError(f"{who}: the residual rows are {tuple(tail.shape)} {tail.dtype}, not {expected} "
                                "floating point")
        packed[entry["index"]] = PackedKV(spec, num_tokens, layers, scales if spec.is_quantized else None, tail)
    return packed


__all__ = ["SnapshotError", "is_snapshot", "load_snapshot", "save_snapshot"]
