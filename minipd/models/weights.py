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
from safetensors import SafetensorError, safe_open

from minipd.models.decoder import DecoderModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the sharded index's files, or the single file.

    A corrupt index is a ``ValueError`` naming it; a missing shard or no weights at all is a
    ``FileNotFoundError`` naming what is missing.
    """
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a valid safetensors index (expected JSON with a "
                             f"'weight_map' of tensor name to shard file): {err!r}") from err
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) missing from {folder}: {', '.join(missing)}")
        return [folder / name for name in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return found


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a checkpoint, one tensor in memory at a time.

    A truncated or corrupt file is a ``ValueError`` naming it (safetensors' own error names no file).
    """
    for path in checkpoint_files(folder):
        try:
            f = safe_open(str(path), framework="pt")
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from err
        with f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as err:
                    raise ValueError(f"{path}: tensor {name!r} cannot be read (truncated or corrupt?): {err}") from err
                yield name, tensor


#: Where in one of our parameters an HF tensor goes: all of it (None), a row range of it, or for
#: stacked expert weights an expert (and optionally that expert's row range).
Index = slice | int | tuple[int, slice] | None


def _target(model: DecoderModel, hf_name: str) -> tuple[str, Index] | None:
    """Our parameter name for an HF tensor and the part of it (see :data:`Index`) that the tensor fills."""
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
    if cfg.model_type == "deepseek_v3" and int(i) >= cfg.num_hidden_layers:
        # DeepSeek-V3 checkpoints append their multi-token-prediction layer(s); inference does not use them.
        return None
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    attn_slices = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    parts = rest.split(".")
    prefix = f"layers.{i}."
    if cfg.is_mla and parts[0] == "self_attn":
        # Multi-head latent attention keeps HF's projections unfused, under HF's names.
        return prefix + rest, None
    if parts[0] == "self_attn" and parts[1] in attn_slices:
        return prefix + f"self_attn.qkv_proj.{parts[2]}", attn_slices[parts[1]]
    if parts[0] == "mlp" and parts[1] in ("gate_proj", "up_proj"):
        half = slice(0, inter) if parts[1] == "gate_proj" else slice(inter, 2 * inter)
        return prefix + "mlp.gate_up_proj.weight", half
    if parts[0] in ("block_sparse_moe", "mlp") and parts[1] == "gate":
        # gate.weight, and DeepSeek-V3's gate.e_score_correction_bias, belong to our router.
        return prefix + "mlp.router." + ".".join(parts[2:]), None
    if parts[0] == "block_sparse_moe" and parts[1] == "experts":
        # Per-expert Mixtral tensors: w1 (gate) and w3 (up) are halves of expert e's gate_up rows, w2 its down_proj.
        expert, which, width = int(parts[2]), parts[3], cfg.expert_intermediate_size
        if which == "w2":
            return prefix + "mlp.experts.down_proj", expert
        half = slice(0, width) if which == "w1" else slice(width, 2 * width)
        return prefix + "mlp.experts.gate_up_proj", (expert, half)
    if parts[0] == "mlp" and parts[1] == "experts" and len(parts) == 5:
        # Per-expert Qwen-MoE tensors: gate_proj and up_proj are halves of expert e's gate_up rows.
        expert, which, width = int(parts[2]), parts[3], cfg.expert_intermediate_size
        if which == "down_proj":
            return prefix + "mlp.experts.down_proj", expert
        half = slice(0, width) if which == "gate_proj" else slice(width, 2 * width)
        return prefix + "mlp.experts.gate_up_proj", (expert, half)
    if parts[0] == "mlp" and parts[1] in ("shared_expert", "shared_experts") and parts[2] in ("gate_proj", "up_proj"):
        # Qwen2-MoE's shared_expert, DeepSeek-V3's shared_experts (all of them as one wide SwiGLU).
        width = cfg.shared_expert_intermediate_size
        half = slice(0, width) if parts[2] == "gate_proj" else slice(width, 2 * width)
        return prefix + "mlp.shared_expert.gate_up_proj.weight", half
    if parts[0] == "mlp" and parts[1] == "shared_experts":
        return prefix + "mlp.shared_expert." + ".".join(parts[2:]), None
    if parts[0] == "mlp" and parts[1] == "experts" and len(parts) == 3:
        # transformers 5 stores all experts of a layer as one (E, out, in) tensor: our layout exactly.
        return prefix + f"mlp.experts.{parts[2]}", None
    return prefix + rest, None


def load_weights(model: DecoderModel, folder: Path) -> None:
    """Copy every tensor of the checkpoint in ``folder`` into ``model``; fail on anything missing."""
    params = dict(model.named_parameters())
    # Elements filled per parameter: fused and stacked parameters are filled piece by piece.
    filled: dict[str, int] = {}
    for hf_name, tensor in iter_checkpoint(folder):
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
        filled[name] = filled.get(name, 0) + tensor.numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) < p.numel()
               and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint in {folder} has no weights for: {', '.join(missing[:8])}"
                         + (" …" if len(missing) > 8 else ""))
