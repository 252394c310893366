"""The paged KV pool: per layer, K and V stored in fixed-size blocks that any sequence can own.

Blocks can also leave and enter the pool whole: :meth:`PagedKVPool.export_blocks` packs a list of
blocks into one contiguous tensor per layer (what a prefill worker sends), and
:meth:`PagedKVPool.import_blocks` writes such tensors into other block ids (what a decode worker
receives). The :class:`~minipd.kv.spec.KVSpec` travels with them, so both ends agree on the format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minipd.kv.quant import FORMATS, QuantizedLayerCache
from minipd.kv.residual import ResidualPlan, WindowedLayerCache
from minipd.kv.spec import KVSpec


@dataclass
class PackedKV:
    """Blocks taken out of a pool: for each layer, K and V of the blocks as one tensor.

    ``layers[i]`` is ``(2, num_blocks, block_size, kv_heads, head_dim)`` (K then V), and for quantized
    specs ``scales[i]`` the matching K and V scales, ``(num_blocks, *spec.key_scale_shape)`` and
    ``(num_blocks, *spec.scale_shape)``.
    ``num_tokens`` says how many leading token slots hold K/V (the last block may be partial).
    """

    spec: KVSpec
    num_tokens: int
    layers: list[torch.Tensor]
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    #: A KIVI pool's partly filled last block as its residual window holds it, in full precision:
    #: ``(2, num_layers, filled, kv_heads, head_dim)``. None when there is none (or it travels as codes only).
    tail: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        """How many blocks were packed."""
        return self.layers[0].shape[1] if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes of values, scales and tail."""
        tail = 0 if self.tail is None else self.tail.nbytes
        return sum(t.nbytes for t in self.layers) + sum(k.nbytes + v.nbytes for k, v in self.scales or ()) + tail


class PagedKVPool:
    """K and V for every layer, shaped (num_layers, num_blocks, block_size, kv_heads, head_dim).

    A latent spec (multi-head latent attention) keeps only K, one row per token of latent and rope key;
    V is allocated zero-width, so the pool's layout and block bookkeeping stay the same.

    A KIVI pool (``spec.has_residual_window``) also keeps ``residual_slots`` full-precision blocks of
    ``residual_dtype`` for sequences' filling blocks (:mod:`minipd.kv.residual`); they are local to
    this pool and never leave it.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str, residual_slots: int = 0,
                 residual_dtype: torch.dtype = torch.float32) -> None:
        shape = (spec.num_layers, num_blocks, *spec.block_shape)
        self.spec = spec
        zero = FORMATS[spec.quant].zero if spec.quant else 0  # what decodes to 0.0
        self.k = torch.full(shape, zero, dtype=spec.dtype, device=device)
        self.v = torch.full((spec.num_layers, num_blocks, *spec.v_block_shape), zero, dtype=spec.dtype, device=device)
        self.k_scale = self.v_scale = None
        if spec.scale_dtype is not None:
            self.k_scale = torch.ones((spec.num_layers, num_blocks, *spec.key_scale_shape), dtype=spec.scale_dtype,
                                      device=device)
            self.v_scale = torch.ones((spec.num_layers, num_blocks, *spec.scale_shape), dtype=spec.scale_dtype,
                                      device=device)
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.num_residual_slots = residual_slots if spec.has_residual_window else 0
        window = (spec.num_layers, self.num_residual_slots, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.residual_k = torch.zeros(window, dtype=residual_dtype, device=device)
        self.residual_v = torch.zeros(window, dtype=residual_dtype, device=device)
        #: The current step's writes into a windowed cache (set by the model runner's ResidualWindow).
        self.step_plan: ResidualPlan | None = None

    @staticmethod
    def residual_bytes(spec: KVSpec, residual_slots: int, residual_dtype: torch.dtype) -> int:
        """Bytes a pool of ``spec`` spends on ``residual_slots`` slots of residual window (0 without one)."""
        if not spec.has_residual_window:
            return 0
        element = torch.empty((), dtype=residual_dtype).element_size()
        return 2 * spec.num_layers * residual_slots * spec.block_size * spec.num_kv_heads * spec.head_dim * element

    def layer(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V caches as the kernels take them: the tensors themselves, or, for a
        quantized pool, views that dequantize to ``dtype`` when read and quantize when written."""
        if self.spec.quant is None:
            return self.k[layer], self.v[layer]
        fmt = FORMATS[self.spec.quant]
        k_scale, v_scale = self.k_scale[layer], self.v_scale[layer]  # type: ignore[index]
        if self.spec.has_residual_window:
            return (WindowedLayerCache(self.k[layer], k_scale, self.residual_k[layer], fmt, dtype, True, self),
                    WindowedLayerCache(self.v[layer], v_scale, self.residual_v[layer], fmt, dtype, False, self))
        return QuantizedLayerCache(self.k[layer], k_scale, fmt, dtype), QuantizedLayerCache(self.v[layer], v_scale,
                                                                                             fmt, dtype)

    def thaw(self, slot: int, block_id: int, filled: int) -> None:
        """Fill residual ``slot`` with the first ``filled`` tokens of ``block_id``, decoded from its codes."""
        for layer in range(self.spec.num_layers):
            for cache, residual in zip(self.layer(layer, self.residual_k.dtype), (self.residual_k, self.residual_v),
                                       strict=True):
                values = cache.decode_blocks(cache.codes[block_id], cache.scales[block_id])  # type: ignore[union-attr]
                residual[layer, slot, :filled] = values[:filled]

    def move_slots(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy token slots ``from -> to`` (``block * block_size + offset``) in every layer, K and V, with their
        per-token scales; all are read before any is written. KIVI's per-channel blocks cannot move a token."""
        if not moves or self.spec.has_residual_window:
            if moves:
                raise ValueError("tokens cannot move between KIVI blocks (their keys share per-channel scales)")
            return
        src = torch.tensor([a for a, _ in moves], dtype=torch.long, device=self.k.device)
        dst = torch.tensor([b for _, b in moves], dtype=torch.long, device=self.k.device)
        tensors = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.k_scale is not None else [])
        for t in tensors:
            rows = t.view(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])  # (layers, slots, ...)
            rows[:, dst] = rows[:, src].clone()

    def keys(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The keys of ``block_ids`` in every layer, as floats: ``(blocks, layers, block_size, heads, dim)``."""
        if self.spec.latent:
            raise ValueError("kv_eviction with a press that scores keys needs per-head keys, but this model uses "
                             "multi-head latent attention and its pool holds compressed latents; choose a press "
                             "that does not read keys, or no kv_eviction")
        layers = [self.layer(i, torch.float32)[0][block_ids] for i in range(self.spec.num_layers)]
        return torch.stack(layers, dim=1).float()

    def keys_shape(self, block_ids: torch.Tensor) -> torch.Tensor:
        """A ``meta`` tensor shaped like :meth:`keys` would return: the shape without the work."""
        spec = self.spec
        return torch.empty((len(block_ids), spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim),
                           device="meta")

    @property
    def num_tokens(self) -> int:
        """How many tokens the pool holds when every block is full."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes taken by K and V (and their scales and residual window) together."""
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes  # type: ignore[union-attr]
        return self.k.nbytes + self.v.nbytes + scales + self.residual_k.nbytes + self.residual_v.nbytes

    def export_blocks(self, block_ids: Sequence[int], num_tokens: int) -> PackedKV:
        """Copy ``block_ids`` out, one packed ``(2, n, block_size, heads, dim)`` tensor per layer."""
        _refuse_latent(self.spec, "exported")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.k.device)
        layers = [torch.stack((self.k[layer, index], self.v[layer, index])) for layer in range(self.spec.num_layers)]
        scales = None
        if self.k_scale is not None:
            scales = [(self.k_scale[layer, index], self.v_scale[layer, index])  # type: ignore[index]
                      for layer in range(self.spec.num_layers)]
        return PackedKV(self.spec, num_tokens, layers, scales)

    def import_blocks(self, block_ids: Sequence[int], packed: PackedKV) -> None:
        """Write ``packed`` into ``block_ids`` (as many as it has blocks); the formats must match."""
        if packed.spec != self.spec:
            raise ValueError(f"KV format mismatch: received {packed.spec.to_dict()}, this pool holds "
                             f"{self.spec.to_dict()}")
        _refuse_latent(self.spec, "imported")
        if len(block_ids) != packed.num_blocks:
            raise ValueError(f"received {packed.num_blocks} blocks but {len(block_ids)} block ids to fill")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.k.device)
        for layer, kv in enumerate(packed.layers):
            self.k[layer, index] = kv[0].to(self.k.device)
            self.v[layer, index] = kv[1].to(self.v.device)
        if self.k_scale is not None and packed.scales is not None:
            for layer, (k_scales, v_scales) in enumerate(packed.scales):
                self.k_scale[layer, index] = k_scales.to(self.k_scale.device)
                self.v_scale[layer, index] = v_scales.to(self.v_scale.device)  # type: ignore[index]


def _refuse_latent(spec: KVSpec, what: str) -> None:
    """KV transfer (prefill/decode disaggregation, snapshots) packs K and V pairs; a latent pool has no V."""
    if spec.latent:
        raise ValueError(f"K/V cannot be {what} (KV transfer, kv connectors, snapshots) for a model with "
                         "multi-head latent attention yet: its pool holds compressed latents, not K/V pairs")
