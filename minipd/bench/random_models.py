"""Random-weight checkpoints of a chosen size, for benchmarks that need more than the bundled models.

``python -m minipd bench --model random-50m`` times a ~50M-parameter Llama (tiny-py's tokenizer, random
weights): the same engine on matrices 2.5x wider than tiny-py's, so the reader sees how per-step
overhead amortises as the model grows. Nothing is downloaded; the folder is built once per shape in
the system's temporary directory and reused.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

#: Named shapes (Llama architecture, tiny-py's 4,096-token vocabulary).
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    # 10 layers of width 640: 49.6M parameters, 8.4x tiny-py.
    "random-50m": dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=10, num_attention_heads=10,
                       num_key_value_heads=2, max_position_embeddings=2048),
}


def random_model_config(name: str) -> dict[str, Any]:
    """The ``config.json`` fields of a named random model."""
    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(RANDOM_MODELS)}")
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=4096, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                **RANDOM_MODELS[name])


def build_random_model(name: str, folder: str | Path | None = None, seed: int = 0) -> Path:
    """A checkpoint folder for ``name`` (random weights, seeded; tiny-py's tokenizer), built if missing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from minipd.models.registry import resolve_model

    folder = Path(folder) if folder is not None else Path(tempfile.gettempdir()) / f"minipd-{name}-seed{seed}"
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = random_model_config(name)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder)
    tokenizer_source = resolve_model("tiny-py")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_source / file, folder / file)
    return folder


__all__ = ["RANDOM_MODELS", "build_random_model", "random_model_config"]
