"""Rotary position embedding (RoPE), including Llama 3's long-context frequency scaling.

RoPE rotates each pair of channels of q and k by an angle proportional to the token's position, so
the dot product q·k depends only on the distance between the two tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minipd.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """One rotation speed per channel pair: ``theta ** (-2i / head_dim)``, then llama3 scaling."""
    # fp32 like HF, so angles at long positions round the same way as the reference.
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended.
    original = rope.original_max_position_embeddings or 8192
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map channel halves ``(a, b)`` to ``(-b, a)``: the 90° turn used by the HF layout of RoPE."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., tokens, heads, head_dim) by per-token angles given as cos and sin."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Caches cos/sin for every position up to ``max_positions`` and looks them up by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos_cached", torch.empty(0), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0), persistent=False)
        self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, e.g. after the module was built on the meta device."""
        inv_freq = inverse_frequencies(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos_cached, self.sin_cached = angles.cos(), angles.sin()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin shaped (tokens, 1, head_dim) for ``positions`` (tokens,), to broadcast over heads.

        Angles are computed in fp32 and applied in the activations' dtype, as HF does.
        """
        cos = self.cos_cached[positions].unsqueeze(-2).to(dtype)
        sin = self.sin_cached[positions].unsqueeze(-2).to(dtype)
        return cos, sin
