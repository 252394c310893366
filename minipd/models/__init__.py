"""Model families (our own implementation, checked against HF transformers) and their loading."""

from minipd.models.decoder import DecoderLayer, DecoderModel, SelfAttention
from minipd.models.loading import load_model
from minipd.models.registry import BUNDLED_MODELS, bundled_models_dir, resolve_model

__all__ = [
    "BUNDLED_MODELS",
    "DecoderLayer",
    "DecoderModel",
    "SelfAttention",
    "bundled_models_dir",
    "load_model",
    "resolve_model",
]
