"""The paged pool seen by the model for one step: where each new token's K/V goes, what each query reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minipd.kernels.backend import KernelBackend
from minipd.kernels.mla import (
    LatentUpProjection,
    paged_mla_decode_torch,
    paged_mla_prefill_torch,
    store_latent_torch,
)
from minipd.kv.paged_pool import PagedKVPool


@dataclass
class PagedAttentionMetadata:
    """Per-step tensors built once by the model runner and shared by every layer.

    The step's tokens are laid out decodes first (one token per sequence), then prefill chunks. A
    token's slot is given, not derived from its position: after token eviction the two differ.
    The ``*_host`` lists repeat the lengths on the CPU, so no layer has to copy them back.
    """

    #: Decode tokens at the front of the batch (one per decoding sequence).
    num_decode_tokens: int
    #: (N,) pool slot (``block * block_size + offset``) of every token of the step.
    slot_mapping: torch.Tensor
    #: (D, max_blocks) block tables and (D,) context lengths of the decoding sequences.
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    #: (P, max_blocks) block tables, (P + 1,) query offsets and (P,) context lengths of the prefills.
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor
    decode_context_lens_host: list[int]
    prefill_query_start_host: list[int]
    prefill_context_lens_host: list[int]


    def split(self, full_decodes: int, full_prefills: int) -> list[CachePart]:
        """The step as two parts, full precision then compressed (adaptive KV precision): the first
        ``full_decodes`` decodes and ``full_prefills`` prefills are full precision, the rest compressed."""
        num_decode, num_prefill = self.num_decode_tokens, len(self.prefill_context_lens_host)
        starts = self.prefill_query_start_host
        parts = []
        for decodes, prefills, compressed in ((slice(0, full_decodes), slice(0, full_prefills), False),
                                              (slice(full_decodes, num_decode), slice(full_prefills, num_prefill),
                                               True)):
            first, last = starts[prefills.start], starts[prefills.stop]
            part = PagedAttentionMetadata(
                num_decode_tokens=decodes.stop - decodes.start,
                slot_mapping=self.slot_mapping,  # (unused: each part stores by its rows)
                decode_block_tables=self.decode_block_tables[decodes],
                decode_context_lens=self.decode_context_lens[decodes],
                prefill_block_tables=self.prefill_block_tables[prefills],
                prefill_query_start_loc=self.prefill_query_start_loc[prefills.start:prefills.stop + 1] - first,
                prefill_context_lens=self.prefill_context_lens[prefills],
                decode_context_lens_host=self.decode_context_lens_host[decodes],
                prefill_query_start_host=[q - first for q in starts[prefills.start:prefills.stop + 1]],
                prefill_context_lens_host=self.prefill_context_lens_host[prefills],
            )
            parts.append(CachePart(part, decodes, slice(num_decode + first, num_decode + last), compressed))
        return parts


@dataclass
class CachePart:
    """Rows of a step whose K/V are in one format (adaptive KV precision), with their own metadata."""

    metadata: PagedAttentionMetadata
    decode_rows: slice
    prefill_rows: slice
    compressed: bool


class PagedKVCache:
    """Implements the model's cache interface over a :class:`PagedKVPool` for one step."""

    def __init__(self, pool: PagedKVPool, metadata: PagedAttentionMetadata, kernels: KernelBackend,
                 on_layer_stored: Callable[[int], None] | None = None,
                 on_attend: Callable[..., None] | None = None, parts: list[CachePart] | None = None) -> None:
        self.pool = pool
        self.metadata = metadata
        self.kernels = kernels
        #: With adaptive KV precision: the step's full-precision and compressed rows (None: one format).
        self.parts = parts
        #: Called with a layer's index as soon as its K/V for this step are in the pool (a KV connector
        #: sends that layer while the next one computes).
        self.on_layer_stored = on_layer_stored
        #: Called as ``on_attend(layer, q, k_cache, scale)`` before each layer attends (presses that
        #: score tokens by the attention they receive watch it here).
        self.on_attend = on_attend

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        if self.parts is not None:
            return self._attend_parts(layer_idx, q, k, v, scale, sliding_window)
        md, kernels = self.metadata, self.kernels
        k_cache, v_cache = self.pool.layer(layer_idx, q.dtype)
        kernels.store_kv(k, v, k_cache, v_cache, md.slot_mapping, has_padding=False)
        if self.on_layer_stored is not None:
            self.on_layer_stored(layer_idx)
        if self.on_attend is not None:
            self.on_attend(layer_idx, q, k_cache, scale)
        num_decode = md.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(q, k_cache, v_cache, scale, sliding_window)
        if num_decode == 0:
            return self._prefill(q, k_cache, v_cache, scale, sliding_window)
        out = torch.empty_like(q)
        out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache, scale, sliding_window)
        out[num_decode:] = self._prefill(q[num_decode:], k_cache, v_cache, scale, sliding_window)
        return out

    def attend_latent(self, layer_idx: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
                      up: LatentUpProjection) -> torch.Tensor:
        """Multi-head latent attention: store each new token's ``rows`` (T, kv_lora_rank + rope) in the pool,
        then attend ``q`` (T, heads, nope + rope) to every cached latent; returns (T, heads, v_head_dim).

        Decode rows use the absorbed form (``up.absorb_decode``), prefill chunks expand the gathered
        latents to per-head K/V (see :mod:`minipd.kernels.mla`). Both are torch code on every backend.
        """
        if not self.pool.spec.latent:
            raise ValueError("this pool stores per-head K/V; a multi-head latent attention model needs a latent "
                             "pool (KVSpec.for_model of its config)")
        if self.parts is not None:
            raise ValueError("kv_cache_dtype='adaptive' cannot serve multi-head latent attention")
        if self.on_attend is not None:
            raise ValueError("kv_eviction by received attention watches per-head keys; this model uses multi-head "
                             "latent attention, whose pool holds compressed latents")
        md = self.metadata
        cache = self.pool.k[layer_idx]
        store_latent_torch(rows, cache, md.slot_mapping)
        if self.on_layer_stored is not None:
            self.on_layer_stored(layer_idx)
        num_decode = md.num_decode_tokens
        out = q.new_empty(q.shape[0], q.shape[1], up.w_uv.shape[1])
        if num_decode:
            out[:num_decode] = paged_mla_decode_torch(q[:num_decode], cache, md.decode_block_tables,
                                                      md.decode_context_lens, scale, up,
                                                      context_lens_host=md.decode_context_lens_host)
        if num_decode < q.shape[0]:
            out[num_decode:] = paged_mla_prefill_torch(q[num_decode:], cache, md.prefill_block_tables,
                                                       md.prefill_query_start_loc, md.prefill_context_lens, scale, up,
                                                       query_start_host=md.prefill_query_start_host,
                                                       context_lens_host=md.prefill_context_lens_host)
        return out

    def _attend_parts(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      sliding_window: int | None) -> torch.Tensor:
        """Each part against its own view of the pool: the pages as floats, or as compressed blocks."""
        out = torch.empty_like(q)
        slots = self.metadata.slot_mapping
        for part in self.parts or ():
            if part.compressed:
                k_cache, v_cache = self.pool.compressed_layer(layer_idx, q.dtype)  # type: ignore[attr-defined]
            else:
                k_cache, v_cache = self.pool.layer(layer_idx, q.dtype)
            for rows in (part.decode_rows, part.prefill_rows):
                if rows.stop > rows.start:
                    self.kernels.store_kv(k[rows], v[rows], k_cache, v_cache, slots[rows], has_padding=False)
            if part.decode_rows.stop > part.decode_rows.start:
                out[part.decode_rows] = self._decode(q[part.decode_rows], k_cache, v_cache, scale, sliding_window,
                                                     part.metadata)
            if part.prefill_rows.stop > part.prefill_rows.start:
                out[part.prefill_rows] = self._prefill(q[part.prefill_rows], k_cache, v_cache, scale, sliding_window,
                                                       part.metadata)
        if self.on_layer_stored is not None:
            self.on_layer_stored(layer_idx)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                sliding_window: int | None, metadata: PagedAttentionMetadata | None = None) -> torch.Tensor:
        md = metadata or self.metadata
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, md.decode_block_tables,
                                                   md.decode_context_lens, scale, sliding_window,
                                                   context_lens_host=md.decode_context_lens_host)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 sliding_window: int | None, metadata: PagedAttentionMetadata | None = None) -> torch.Tensor:
        md = metadata or self.metadata
        return self.kernels.paged_prefill_attention(q, k_cache, v_cache, md.prefill_block_tables,
                                                    md.prefill_query_start_loc, md.prefill_context_lens, scale,
                                                    sliding_window, query_start_host=md.prefill_query_start_host,
                                                    context_lens_host=md.prefill_context_lens_host)

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: the scheduler tracks what is computed."""
