"""The building blocks of a decoder layer, each small enough to read in one sitting."""

from minipd.layers.attention import attention
from minipd.layers.mlp import SwiGLU
from minipd.layers.moe import MoE
from minipd.layers.norm import RMSNorm, rms_norm
from minipd.layers.rotary import RotaryEmbedding, apply_rotary, rotate_half
from minipd.layers.sampler import sample_next_tokens

__all__ = [
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "attention",
    "rms_norm",
    "rotate_half",
    "sample_next_tokens",
]
