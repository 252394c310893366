"""Quantized KV caches: 8- or 4-bit values with a scale per token per KV head.

A token's K (or V) in one KV head is a vector of ``head_dim`` numbers. We store it as 8- or 4-bit
codes plus one fp16 scale, chosen so the vector's largest magnitude maps to the format's largest code:

- ``"int8"``: symmetric integers in [-127, 127]; ``x ≈ code * scale``, ``scale = max|x| / 127``;
- ``"fp8"``: float8 e4m3 (3 mantissa bits, largest 448); ``x ≈ float(code) * scale``,
  ``scale = max|x| / 448``. Its relative error is the same at every magnitude, int8's is not.
- ``"int4"``: symmetric integers in [-7, 7], two to a byte (``code + 8`` in each nibble, the even
  dimension in the low one). A quarter of fp16's bytes plus the scale; sixteen times int8's step.

Per token (rather than per tensor or per block) means a token written later never changes the scale
of one written earlier, so a block can be filled one decode step at a time, and a prefix-cached block
means the same bytes to every reader. The scales cost ``2 / head_dim`` of the fp16 bytes (6% at
head_dim 32, 1.6% at 128), and the spec counts them.

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

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (``x``'s shape, the last dimension divided by :attr:`pack`; :attr:`storage`) and fp16
        scales (``x.shape[:-1]``) for ``x``."""
        xf = x.float()
        # Scales are stored in fp16; quantize with the rounded scale, so decoding is exact to it.
        scale = (xf.abs().amax(dim=-1) / self.qmax).clamp_min(2.0**-24).to(torch.float16)
        scaled = xf / scale.float().unsqueeze(-1)
        if self.name == "int8":
            return scaled.round().clamp(-self.qmax, self.qmax).to(torch.int8), scale
        if self.name == "int4":
            nibbles = (scaled.round().clamp(-self.qmax, self.qmax) + 8).to(torch.uint8)
            return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scale
        return scaled.clamp(-self.qmax, self.qmax).to(torch.float8_e4m3fn).view(torch.uint8), scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values of ``dtype`` from codes and their scales (``codes.shape[:-1]``)."""
        if self.name == "int4":
            values = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).to(torch.float32) - 8
        else:
            values = (codes.view(torch.float8_e4m3fn) if self.name == "fp8" else codes).to(torch.float32)
        return (values * scales.to(torch.float32).unsqueeze(-1)).to(dtype)


FORMATS: dict[str, QuantFormat] = {
    "int8": QuantFormat("int8", torch.int8, 127.0),
    "fp8": QuantFormat("fp8", torch.uint8, 448.0),
    "int4": QuantFormat("int4", torch.uint8, 7.0, pack=2, zero=0x88),
}


def fake_quantize(x: torch.Tensor, format_name: str) -> torch.Tensor:
    """``x`` after a round trip through ``format_name`` (what attention will read back), in ``x``'s dtype."""
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

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """The dequantized blocks at ``index`` (block ids, any shape)."""
        return self.fmt.dequantize(self.codes[index], self.scales[index], self.dtype)

    def store(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x`` (N, kv_heads, head_dim) into slots ``slot_mapping`` (N,), in place."""
        codes, scales = self.fmt.quantize(x)
        heads, dim = self.codes.shape[-2:]
        self.codes.view(-1, heads, dim).index_copy_(0, slot_mapping, codes)
        self.scales.view(-1, heads).index_copy_(0, slot_mapping, scales)
