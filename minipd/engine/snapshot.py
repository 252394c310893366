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
field, and the engine is left as it was (the checks of each request: :mod:`minipd.engine.snapshot_checks`).

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

import hashlib
import json
import os
import secrets
import tempfile
import warnings
from pathlib import Path
from typing import Any

from minipd.engine.snapshot_checks import METRIC_FIELDS, PARAM_FIELDS, Engine, SnapshotError, check_entry
from minipd.kv.paged_pool import PackedKV
from minipd.kv.spec import KVSpec
from minipd.outputs import RequestMetrics

FORMAT = "minipd-snapshot"
#: 2: the manifest is checksummed and carries log-probabilities (version 1 is refused: it had no checksum).
VERSION = 2
MANIFEST = "manifest.json"
KV_FILE = "kv.safetensors"
#: Every file a snapshot folder holds: nothing else is ever removed when one is replaced.
SNAPSHOT_FILES = (MANIFEST, KV_FILE)


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
        metrics = {f: getattr(state.metrics, f) for f in METRIC_FIELDS if f != "kv_timeline"}
        entries.append({
            "index": index, "request_id": state.request_id, "prompt": state.prompt,
            "all_token_ids": list(request.all_token_ids), "num_prompt_tokens": request.num_prompt_tokens,
            "params": {name: getattr(state.params, name) for name in PARAM_FIELDS},
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
        checked = [check_entry(engine, entry, f"{path / MANIFEST}: requests[{i}]")
                   for i, entry in enumerate(manifest["requests"])]
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
