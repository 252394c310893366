"""Quantized KV caches: 8- or 4-bit values with their scales.

A token's K (or V) in one KV head is a vector of ``head_dim`` numbers. The simple formats store it as
8- or 4-bit codes plus one fp16 scale, chosen so the vector's largest magnitude maps to the format's
largest code:

- ``"int8"``: symmetric integers in [-127, 127]; ``x ≈ code * scale``, ``scale = max|x| / 127``;
- ``"fp8"``: float8 e4m3 (3 mantissa bits, largest 448); ``x ≈ float(code) * scale``,
  ``scale = max|x| / 448``. Its relative error is the same at every magnitude, int8's is not.
- ``"int4_per_token"``: symmetric integers in [-7, 7], two to a byte (``code + 8`` in each nibble, the
  even dimension in the low one). A quarter of fp16's bytes plus the scale; sixteen times int8's step.

Per token (rather than per tensor or per block) means a token written later never changes the scale
of one written earlier, so a block can be filled one decode step at a time, and a prefix-cached block
means the same bytes to every reader. The scales cost ``2 / head_dim`` of the fp16 bytes (6% at
head_dim 32, 1.6% at 128), and the spec counts them.

``"int4"`` is KIVI's recipe (Liu et al., 2024). Keys have outlier *channels* (a few dimensions are
large in every token), so a per-token scale stretched by them leaves the other dimensions few codes;
KIVI quantizes K per channel instead (one scale per dimension, over a group of tokens: here a block)
and V per token. A per-channel scale needs the whole group, so a block's newest tokens stay in full
precision in a *residual window* (:mod:`minipd.kv.residual`) until the block fills, and only then
become codes. K's scales cost ``2 / block_size`` of fp16's bytes, V's ``2 / head_dim``.

:class:`QuantizedLayerCache` wraps one layer's codes and scales so that the attention kernels read it
as if it held floats: indexing it with block ids returns dequantized K/V, and the store kernel
quantizes on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """A code format: how codes are stored and the largest magnitude a code holds."""

    name: str
    #: The dtype of the stored codes (fp8 is stored as its raw bytes, ``uint8``, so that every indexing
    #: and copy op works on it on every device).
    storage: torch.dtype
    qmax: float
    #: Codes per stored element (2: int4 nibbles packed in a byte).
    pack: int = 1
    #: The stored element that decodes to zero (an empty pool is filled with it).
    zero: int = 0

    #: K gets a scale per channel within each block, V one per token, and the filling block waits in a
    #: full-precision residual window (KIVI; see the module docstring).
    per_channel_keys: bool = False

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (``x``'s shape, the last dimension divided by :attr:`pack`; :attr:`storage`) and fp16
        scales (``x.shape[:-1]``) for ``x``: one scale per row of the last dimension."""
        xf = x.float()
        scale = self._scale(xf.abs().amax(dim=-1))
        return self._encode(xf / scale.float().unsqueeze(-1)), scale

    def quantize_channels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``x`` (..., block_size, heads, dim) with a scale per channel: codes as :meth:`quantize`
        gives them and fp16 scales (..., heads, dim), each over the block's tokens."""
        xf = x.float()
        scale = self._scale(xf.abs().amax(dim=-3))
        return self._encode(xf / scale.float().unsqueeze(-3)), scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values of ``dtype`` from codes and their per-row scales (``codes.shape[:-1]``)."""
        return (self._decode(codes) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)

    def dequantize_channels(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values of ``dtype`` from blocks of codes (..., block_size, heads, dim / pack) and their per-channel
        scales (..., heads, dim)."""
        return (self._decode(codes) * scales.to(torch.float32).unsqueeze(-3)).to(dtype)

    def _scale(self, absmax: torch.Tensor) -> torch.Tensor:
        # Scales are stored in fp16; codes are computed with the rounded scale, so decoding is exact to it.
        return (absmax / self.qmax).clamp_min(2.0**-24).to(torch.float16)

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.name == "fp8":
            return scaled.clamp(-self.qmax, self.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
        ints = scaled.round().clamp(-self.qmax, self.qmax)
        if self.pack == 1:
            return ints.to(self.storage)
        nibbles = (ints + 8).to(torch.uint8)
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        if self.pack == 2:
            return torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).to(torch.float32) - 8
        return (codes.view(torch.float8_e4m3fn) if self.name == "fp8" else codes).to(torch.float32)


FORMATS: dict[str, QuantFormat] = {
    "int8": QuantFormat("int8", torch.int8, 127.0),
    "fp8": QuantFormat("fp8", torch.uint8, 448.0),
    "int4_per_token": QuantFormat("int4_per_token", torch.uint8, 7.0, pack=2, zero=0x88),
    "int4": QuantFormat("int4", torch.uint8, 7.0, pack=2, zero=0x88, per_channel_keys=True),
}


#: The formats with a scale per token for K and V alike (every one but KIVI's "int4"): what adaptive
#: precision and a compressed wire can use.
PER_TOKEN_FORMATS: tuple[str, ...] = tuple(name for name, fmt in FORMATS.items() if not fmt.per_channel_keys)


def fake_quantize(x: torch.Tensor, format_name: str) -> torch.Tensor:
    """``x`` after a round trip through ``format_name``'s per-token codes, in ``x``'s dtype (what attention
    reads back of a value, or of a key in a per-token format)."""
    fmt = FORMATS[format_name]
    codes, scales = fmt.quantize(x)
    return fmt.dequantize(codes, scales, x.dtype)


class QuantizedLayerCache:
    """One layer's K (or V) in a quantized pool, read and written as if it held floats.

    Args:
        codes: ``(num_blocks, block_size, kv_heads, head_dim // fmt.pack)`` codes of :attr:`fmt`'s storage dtype.
        scales: ``(num_blocks, block_size, kv_heads)`` fp16 scales.
        fmt: the code format.
        dtype: what reads return (the queries' dtype).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> None:
        self.codes, self.scales, self.fmt, self.dtype = codes, scales, fmt, dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of the values it stands for."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * self.fmt.pack))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Values of blocks given as their codes and scales."""
        return self.fmt.dequantize(codes, scales, self.dtype)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """The dequantized blocks at ``index`` (block ids, any shape)."""
        return self.decode_blocks(self.codes[index], self.scales[index])

    def store(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x`` (N, kv_heads, head_dim) into slots ``slot_mapping`` (N,), in place."""
        codes, scales = self.fmt.quantize(x)
        heads, dim = self.codes.shape[-2:]
        self.codes.view(-1, heads, dim).index_copy_(0, slot_mapping, codes)
        self.scales.view(-1, heads).index_copy_(0, slot_mapping, scales)
