"""Where models come from: the bundled tiny models, a local HF folder, or the hub when online."""

from __future__ import annotations

import os
from pathlib import Path

#: The models that ship in ``assets/models``, so every chapter runs offline.
BUNDLED_MODELS: dict[str, str] = {
    "tiny-py": "5M-parameter dense Llama-style decoder trained on the Python standard library",
    "tiny-py-moe": "11M-parameter Mixtral-style decoder (8 experts, top-2) trained on the same corpus",
}


def bundled_models_dir() -> Path:
    """``$MINIPD_MODELS_DIR`` if set, else ``assets/models`` of the repository minipd runs from."""
    override = os.environ.get("MINIPD_MODELS_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "assets" / "models"


def resolve_model(model: str | os.PathLike) -> Path:
    """A local folder holding the model: bundled name, existing folder, or hub id (downloaded).

    Raises ValueError naming ``model`` (and the bundled models) when it is none of these, or a file
    rather than a folder; FileNotFoundError when a bundled model's files are missing.
    """
    name = str(model)
    if name in BUNDLED_MODELS:
        path = bundled_models_dir() / name
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"bundled model {name!r} is missing from {path}; run `python scripts/train_tiny.py "
                f"--model {name}` or set MINIPD_MODELS_DIR"
            )
        return path
    path = Path(name).expanduser()
    if path.is_file():  # e.g. the model.safetensors or config.json itself
        raise ValueError(f"model {name!r} is a file; pass the folder that holds config.json and the weights")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json (expected an HF-format model folder)")
        return path
    bundled = ", ".join(sorted(BUNDLED_MODELS))
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ValueError(f"model {name!r} is not a bundled model ({bundled}) nor a local folder")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ValueError(f"model {name!r} is not a bundled model ({bundled}) nor a local folder, "
                         "and HF_HUB_OFFLINE is set, so the hub is not asked")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as err:  # network errors, unknown repos, gated repos
        raise ValueError(f"model {name!r} is not a bundled model ({bundled}), not a local folder, "
                         f"and could not be fetched from the hub: {err}") from err
