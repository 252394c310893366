"""Resumable snapshots (断点续传): every unfinished request and its K/V, saved to disk and loaded again.

A snapshot is a folder with two files:

- ``manifest.json``: the format and its version, the model's shape, the :class:`~minipd.kv.spec.KVSpec`,
  and per request its tokens, sampling parameters, seed (with the token index, all the RNG state
  sampling needs), metrics, and how many tokens of K/V were saved;
- ``kv.safetensors``: per request, one packed ``(2, blocks, block_size, kv_heads, head_dim)`` tensor
  per layer, named ``{request index}.{layer}``; its SHA-256 is in the manifest.

Loading checks everything before admitting anything — format, version, model, KV format, the
file's checksum, every tensor's shape — so a corrupt, partial or mismatched snapshot is refused with
a clear error and the engine is left as it was. Snapshots are written to a temporary folder and
renamed into place, so a crash while saving leaves the previous snapshot whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minipd.kv.paged_pool import PackedKV
from minipd.kv.spec import KVSpec
from minipd.outputs import RequestMetrics
from minipd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minipd.engine.engine import Engine

FORMAT = "minipd-snapshot"
VERSION = 1
MANIFEST = "manifest.json"
KV_FILE = "kv.safetensors"

#: SamplingParams fields saved (the private stop list is rebuilt from ``stop``).
_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded: corrupt, partial, or made for another model or KV format."""


def model_fingerprint(engine: Engine) -> dict[str, Any]:
    """What a snapshot's K/V depend on: the model's shape (weights are not hashed: they are the user's call)."""
    cfg = engine.core.model.config
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "max_model_len": engine.max_model_len}


def save_snapshot(engine: Engine, path: str | os.PathLike) -> Path:
    """Write every unfinished request of ``engine`` and its computed K/V to the folder ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
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
        entries.append({
            "index": index, "request_id": state.request_id, "prompt": state.prompt,
            "all_token_ids": list(request.all_token_ids), "num_prompt_tokens": request.num_prompt_tokens,
            "params": {name: getattr(state.params, name) for name in _PARAM_FIELDS},
            "seed": request.seed, "hold_kv": request.hold_kv, "num_kv_tokens": num_kv,
            "metrics": {f.name: getattr(state.metrics, f.name) for f in dataclasses.fields(RequestMetrics)},
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        kv_path = staging / KV_FILE
        save_file(tensors, str(kv_path), metadata={"format": FORMAT})
        manifest = {"format": FORMAT, "version": VERSION, "model": model_fingerprint(engine),
                    "kv_spec": engine.core.kv_spec.to_dict(), "kv_sha256": _sha256(kv_path),
                    "requests": entries}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        # Swap in whole: a crash before this line leaves the previous snapshot as it was.
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        staging.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def load_snapshot(engine: Engine, path: str | os.PathLike) -> list[str]:
    """Re-admit the requests saved in ``path`` into ``engine`` (same model and KV format); return their ids.

    Everything is checked before any request is added; on any problem, :class:`SnapshotError`.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    _check_compatible(engine, manifest, path)
    packed = _read_kv(path, manifest, engine.core.kv_spec)
    states = []
    for entry in manifest["requests"]:
        try:
            params = SamplingParams(**entry["params"])
            ids = entry["all_token_ids"][:entry["num_prompt_tokens"]]
            state = engine.make_request(ids, params, request_id=entry["request_id"],
                                        hold_kv=entry["hold_kv"], num_external_tokens=entry["num_kv_tokens"])
        except (KeyError, TypeError, ValueError) as err:
            raise SnapshotError(f"{path / MANIFEST}: request {entry.get('request_id')!r} cannot be restored: "
                                f"{err}") from None
        request = state.request
        request.all_token_ids[:] = entry["all_token_ids"]
        request.seed = entry["seed"]
        state.prompt = entry["prompt"]
        state.metrics = RequestMetrics(**entry["metrics"])
        if entry["num_kv_tokens"] >= request.num_tokens:
            raise SnapshotError(f"{path / MANIFEST}: request {entry['request_id']!r} has K/V for more tokens "
                                "than it holds")
        states.append((state, packed.get(entry["index"])))
    for state, kv in states:
        engine.add(state, kv=kv)
        engine.processor.replay(state, state.request.output_token_ids)
    return [state.request_id for state, _ in states]


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
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{manifest_path} is not valid JSON ({err}): the snapshot is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{manifest_path} is not a minipd snapshot")
    if manifest.get("version") != VERSION:
        raise SnapshotError(f"{manifest_path} is snapshot version {manifest.get('version')!r}; this minipd reads "
                            f"version {VERSION}")
    if not isinstance(manifest.get("requests"), list):
        raise SnapshotError(f"{manifest_path} lists no requests: the snapshot is corrupt")
    return manifest


def _check_compatible(engine: Engine, manifest: dict[str, Any], path: Path) -> None:
    ours = model_fingerprint(engine)
    theirs = manifest.get("model", {})
    differ = [f"{k} {theirs.get(k)!r} (here {v!r})" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise SnapshotError(f"{path} was taken with another model: {', '.join(differ)}")
    spec = engine.core.kv_spec.to_dict()
    saved = manifest.get("kv_spec", {})
    differ = [f"{k} {saved.get(k)!r} (here {v!r})" for k, v in spec.items() if saved.get(k) != v]
    if differ:
        raise SnapshotError(f"{path} stores K/V in another format: {', '.join(differ)}")


def _read_kv(path: Path, manifest: dict[str, Any], spec: KVSpec) -> dict[int, PackedKV]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    kv_path = path / KV_FILE
    if not kv_path.is_file():
        raise SnapshotError(f"{kv_path} is missing: the snapshot is partial")
    if _sha256(kv_path) != manifest.get("kv_sha256"):
        raise SnapshotError(f"{kv_path} does not match the checksum in its manifest: the snapshot is corrupt "
                            "or partly written")
    try:
        tensors = load_file(str(kv_path))
    except (SafetensorError, OSError) as err:
        raise SnapshotError(f"{kv_path} cannot be read: {err}") from None
    packed = {}
    for entry in manifest["requests"]:
        num_tokens = entry.get("num_kv_tokens", 0)
        if not num_tokens:
            continue
        blocks = -(-num_tokens // spec.block_size)
        shape = (2, blocks, *spec.block_shape)
        layers, scales = [], []
        for layer in range(spec.num_layers):
            tensor = tensors.get(f"{entry['index']}.{layer}")
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != spec.dtype:
                raise SnapshotError(f"{kv_path}: the K/V of request {entry.get('request_id')!r}, layer {layer}, "
                                    f"is missing or not {shape} {spec.dtype}")
            layers.append(tensor)
            if spec.is_quantized:
                pair = []
                for name, per_block in (("k_scales", spec.key_scale_shape), ("v_scales", spec.scale_shape)):
                    tensor = tensors.get(f"{entry['index']}.{layer}.{name}")
                    expected = (blocks, *per_block)
                    if tensor is None or tuple(tensor.shape) != expected or tensor.dtype != spec.scale_dtype:
                        raise SnapshotError(f"{kv_path}: the {name[0].upper()} scales of request "
                                            f"{entry.get('request_id')!r}, layer {layer}, are missing or not "
                                            f"{expected} {spec.scale_dtype}")
                    pair.append(tensor)
                scales.append((pair[0], pair[1]))
        tail = tensors.get(f"{entry['index']}.tail")
        filled = num_tokens % spec.block_size
        if tail is not None and tuple(tail.shape) != (2, spec.num_layers, filled, spec.num_kv_heads, spec.head_dim):
            raise SnapshotError(f"{kv_path}: the residual rows of request {entry.get('request_id')!r} are "
                                f"{tuple(tail.shape)}, not (2, {spec.num_layers}, {filled}, {spec.num_kv_heads}, "
                                f"{spec.head_dim})")
        packed[entry["index"]] = PackedKV(spec, num_tokens, layers, scales if spec.is_quantized else None, tail)
    return packed


__all__ = ["SnapshotError", "load_snapshot", "save_snapshot"]
