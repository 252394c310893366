"""Read HF safetensors checkpoints (one file or sharded) into a :class:`DecoderModel`.

HF keeps q, k and v (and gate and up) as separate matrices; minipd fuses each group into one
projection, so the loader maps every HF tensor to a slice of one of our parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from minipd.models.decoder import DecoderModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the sharded index's files, or the single file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return found


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a checkpoint, one tensor in memory at a time."""
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _target(model: DecoderModel, hf_name: str) -> tuple[str, slice | None] | None:
    """Our parameter name for an HF tensor and the row slice of it that the tensor fills."""
    cfg = model.config
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        return (None if cfg.tie_word_embeddings else ("lm_head.weight", None))
    match = _LAYER.match(hf_name)
    if match is None or hf_name.endswith("rotary_emb.inv_freq"):
        return None
    i, rest = match.group(1), match.group(2)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    attn_slices = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    parts = rest.split(".")
    prefix = f"layers.{i}."
    if parts[0] == "self_attn" and parts[1] in attn_slices:
        return prefix + f"self_attn.qkv_proj.{parts[2]}", attn_slices[parts[1]]
    if parts[0] == "mlp" and parts[1] in ("gate_proj", "up_proj"):
        half = slice(0, inter) if parts[1] == "gate_proj" else slice(inter, 2 * inter)
        return prefix + "mlp.gate_up_proj.weight", half
    if parts[0] in ("block_sparse_moe", "mlp") and parts[1] == "gate":
        return prefix + "mlp.router.weight", None
    if parts[0] == "block_sparse_moe" and parts[1] == "experts":
        expert, which = parts[2], parts[3]
        rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": None}[which]
        name = "down_proj" if which == "w2" else "gate_up_proj"
        return prefix + f"mlp.experts.{expert}.{name}.weight", rows
    return prefix + rest, None


def load_weights(model: DecoderModel, folder: Path) -> None:
    """Copy every tensor of the checkpoint in ``folder`` into ``model``; fail on anything missing."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for hf_name, tensor in iter_checkpoint(folder):
        if _load_fused_experts(model, params, filled, hf_name, tensor):
            continue
        target = _target(model, hf_name)
        if target is None:
            continue
        name, rows = target
        if name not in params:
            raise KeyError(f"checkpoint tensor {hf_name!r} maps to {name!r}, which the model does not have")
        dest = params[name].data if rows is None else params[name].data[rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
        dest.copy_(tensor)
        filled[name] = filled.get(name, 0) + tensor.shape[0]
    missing = [n for n, p in params.items() if filled.get(n, 0) < p.shape[0]
               and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint in {folder} has no weights for: {', '.join(missing[:8])}"
                         + (" …" if len(missing) > 8 else ""))


def _load_fused_experts(model: DecoderModel, params: dict, filled: dict, hf_name: str,
                        tensor: torch.Tensor) -> bool:
    """transformers 5 may store all experts of a layer as one (E, out, in) tensor; split it."""
    match = _LAYER.match(hf_name)
    if match is None or not re.fullmatch(r"mlp\.experts\.(gate_up_proj|down_proj)", match.group(2)):
        return False
    kind = match.group(2).rsplit(".", 1)[1]
    for e in range(tensor.shape[0]):
        name = f"layers.{match.group(1)}.mlp.experts.{e}.{kind}.weight"
        params[name].data.copy_(tensor[e])
        filled[name] = tensor.shape[1]
    return True
