"""Rotary position embedding (RoPE), including Llama 3's and YaRN's long-context frequency scaling.

RoPE rotates each pair of channels of q and k by an angle proportional to the token's position, so
the dot product q·k depends only on the distance between the two tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minipd.config import RopeConfig
from minipd.kernels.rotary import apply_rotary, rotate_half

__all__ = ["RotaryEmbedding", "apply_rotary", "deinterleave", "inverse_frequencies", "rope_attention_factor",
           "rotate_half", "yarn_mscale"]


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """One rotation speed per channel pair: ``theta ** (-2i / head_dim)``, then llama3 or YaRN scaling."""
    # fp32 like HF, so angles at long positions round the same way as the reference.
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_scale(head_dim, rope)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for stretching the context ``factor`` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: 1, except for YaRN, which sharpens attention at long range.

    The config's ``attention_factor`` when given; else the ratio of the two mscales when both are set
    (DeepSeek-V3's 1.0 and 1.0 make it 1), else the plain YaRN correction of ``factor``.
    """
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_scale(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    # Fast-turning pairs (many turns over the original context) keep their frequency, slow ones are divided
    # by `factor`, and a linear ramp between the pairs turning beta_fast and beta_slow times blends the two.
    original = rope.original_max_position_embeddings or 4096
    base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / base, 1.0 / (rope.factor * base)

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair_turning(rope.beta_fast), pair_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


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


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels ``(x0, x1, x2, x3, ...)`` as ``(x0, x2, ..., x1, x3, ...)``: evens, then odds.

    DeepSeek rotates adjacent pairs ``(x0, x1), (x2, x3), ...``; after this reordering those pairs are
    ``(i, i + d/2)``, the halves :func:`apply_rotary` turns, so one rotary code path serves both layouts.
    HF's DeepSeek produces its rotated q and k in this same evens-then-odds order, and the order is the
    same for queries and keys, so their dot products do not change.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin for every position up to ``max_positions`` and looks them up by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos_cached", torch.empty(0), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0), persistent=False)
        if self.cos_cached.device.type != "meta":  # built on the meta device: the tables come with reset_cache(device)
            self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, e.g. after the module was built on the meta device."""
        inv_freq = inverse_frequencies(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos_cached, self.sin_cached = angles.cos(), angles.sin()
        factor = rope_attention_factor(self.rope)
        if factor != 1.0:  # YaRN scales the rotated q and k (so their product by its square), as HF does
            self.cos_cached, self.sin_cached = self.cos_cached * factor, self.sin_cached * factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin shaped (tokens, 1, head_dim) for ``positions`` (tokens,), to broadcast over heads.

        Angles are computed in fp32 and applied in the activations' dtype, as HF does.
        """
        cos = self.cos_cached[positions].unsqueeze(-2).to(dtype)
        sin = self.sin_cached[positions].unsqueeze(-2).to(dtype)
        return cos, sin
