"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over cached latents: torch references.

An MLA cache keeps, per token and layer, one row of ``kv_lora_rank + qk_rope_head_dim`` numbers: the
token's compressed latent ``c`` (already RMS-normed) followed by its rotary key ``k_rope`` (already
rotated), which every head shares. There is no per-head K or V anywhere in the pool. Head ``h``'s
key and value are linear in the latent:

    k_h = [W_UK_h · c, k_rope]        v_h = W_UV_h · c

so attention over the cache can be computed two ways, both exact:

* **expanded**: up-project every gathered row to per-head K and V, then ordinary attention. Simple; it
  costs ``heads × (qk_nope + v)`` multiply-adds per cached row per step, which is fine for a prefill
  chunk (many queries share the expansion) and wasteful for a decode (one query per sequence).
* **absorbed**: fold ``W_UK_h`` into the query (``q_h · k_h = (W_UK_hᵀ q_nope_h) · c + q_rope_h · k_rope``),
  attend with that in the latent space, where every head reads the same cached row (multi-query attention
  with one KV "head" of the row itself, and the latent part of the row as the value), and apply ``W_UV_h``
  to the per-head result afterwards. The cache is read as stored; nothing per row is up-projected.

The pool for one layer is ``(num_blocks, block_size, 1, latent_dim)``; a slot is
``block * block_size + offset`` as for ordinary K/V (see :mod:`minipd.kernels.paged_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minipd.kernels.attention import attention
from minipd.kernels.paged_attention import gather_kv


@dataclass(frozen=True)
class LatentUpProjection:
    """A layer's up-projection from the cached latent to per-head keys and values (views of ``kv_b_proj``).

    ``w_uk`` is (heads, qk_nope_head_dim, kv_lora_rank) and ``w_uv`` (heads, v_head_dim, kv_lora_rank).
    ``absorb_decode`` chooses the form one-query rows are computed in (both are exact).
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    absorb_decode: bool = True

    @property
    def kv_lora_rank(self) -> int:
        """Width of the latent."""
        return self.w_uk.shape[-1]

    @property
    def nope_dim(self) -> int:
        """Width of each head's key part without position (from the latent)."""
        return self.w_uk.shape[1]

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head K (S, heads, nope + rope) and V (S, heads, v) from cached rows (S, kv_lora_rank + rope)."""
        latent, k_rope = rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:]
        k_nope = torch.einsum("sr,hdr->shd", latent, self.w_uk)
        v = torch.einsum("sr,hdr->shd", latent, self.w_uv)
        k_rope = k_rope[:, None, :].expand(-1, k_nope.shape[1], -1)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """Queries (T, heads, nope + rope) moved into the latent space: (T, heads, kv_lora_rank + rope)."""
        q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
        return torch.cat((torch.einsum("thd,hdr->thr", q_nope, self.w_uk), q_rope), dim=-1)

    def project_values(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Per-head attention results in the latent space (T, heads, kv_lora_rank) as values (T, heads, v)."""
        return torch.einsum("thr,hdr->thd", out_latent, self.w_uv)


def expanded_latent_attention(q: torch.Tensor, rows: torch.Tensor, scale: float,
                              up: LatentUpProjection) -> torch.Tensor:
    """Causal attention of ``q`` (T, heads, nope + rope), the last T of S positions, to cached ``rows``
    (S, latent_dim), by up-projecting the rows to per-head K and V. Returns (T, heads, v_head_dim)."""
    k, v = up.expand(rows.to(q.dtype))
    return attention(q, k, v, scale)


def absorbed_latent_attention(q_latent: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None,
                              scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Attention in the latent space: ``q_latent`` (B, heads, latent_dim) scores each sequence's ``rows``
    (B, S, latent_dim) and sums their latent parts. ``mask`` (B, S) is True where a row counts (None: all).

    Every head reads the same rows, so this is multi-query attention with the cached row as the key and
    its first ``kv_lora_rank`` numbers as the value. Returns (B, heads, kv_lora_rank).
    """
    rows = rows.to(q_latent.dtype)
    scores = torch.einsum("bhd,bsd->bhs", q_latent, rows) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    # fp32 softmax like the attention kernels, so bf16 runs stay close to the reference.
    weights = scores.float().softmax(dim=-1).to(q_latent.dtype)
    return torch.einsum("bhs,bsr->bhr", weights, rows[..., :kv_lora_rank])


def store_latent_torch(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy ``rows`` (N, latent_dim) into the layer's latent cache (blocks, block_size, 1, latent_dim) at
    ``slot_mapping`` (N,), in place. Every slot must be valid (the model runner pads nothing)."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def paged_mla_decode_torch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, up: LatentUpProjection, *,
                           context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """One query per sequence, ``q`` (B, heads, nope + rope), against its paged latents; (B, heads, v_head_dim).

    Absorbed form when ``up.absorb_decode`` (one padded batch, rows past a sequence's length masked),
    else each sequence's rows are expanded as a prefill would.
    """
    lengths = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    if not up.absorb_decode:
        out = q.new_empty(q.shape[0], q.shape[1], up.w_uv.shape[1])
        for i, length in enumerate(lengths):
            rows = gather_kv(cache, block_tables[i], length)[:, 0]
            out[i:i + 1] = expanded_latent_attention(q[i:i + 1], rows, scale, up)
        return out
    batch, block_size, dim = q.shape[0], cache.shape[1], cache.shape[-1]
    blocks = -(-max(lengths) // block_size)
    span = blocks * block_size
    rows = cache[block_tables[:, :blocks]].view(batch, span, dim)
    mask = None
    if batch > 1:
        mask = torch.arange(span, device=q.device)[None, :] < context_lens.to(q.device)[:, None]
    elif span > lengths[0]:
        rows = rows[:, :lengths[0]]
    out_latent = absorbed_latent_attention(up.absorb_query(q), rows, mask, scale, up.kv_lora_rank)
    return up.project_values(out_latent)


def paged_mla_decode_with_new(q: torch.Tensor, rows_new: torch.Tensor, cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              up: LatentUpProjection) -> torch.Tensor:
    """:func:`paged_mla_decode_torch` with static shapes and no host reads, for a compiled decode step: each
    sequence's last position comes from ``rows_new`` (B, latent_dim), not the cache (whose slot for it need not
    be written yet), and the whole width of ``block_tables`` is gathered, positions past ``context_lens``
    masked. Returns (B, heads, v_head_dim)."""
    batch, block_size, dim = q.shape[0], cache.shape[1], cache.shape[-1]
    span = block_tables.shape[1] * block_size
    rows = cache[block_tables].view(batch, span, dim)
    pos = torch.arange(span, device=q.device)[None, :]
    lens = context_lens.to(q.device)[:, None]
    rows = torch.where((pos == lens - 1)[:, :, None], rows_new[:, None].to(rows.dtype), rows)
    mask = pos < lens
    if up.absorb_decode:
        return up.project_values(absorbed_latent_attention(up.absorb_query(q), rows, mask, scale, up.kv_lora_rank))
    k, v = up.expand(rows.reshape(batch * span, dim).to(q.dtype))
    k = k.view(batch, span, *k.shape[1:]).transpose(1, 2)
    v = v.view(batch, span, *v.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.squeeze(2)


def paged_mla_prefill_torch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            up: LatentUpProjection, *, query_start_host: Sequence[int] | None = None,
                            context_lens_host: Sequence[int] | None = None) -> torch.Tensor:
    """Chunks of queries (causal, variable lengths; see :func:`~minipd.kernels.paged_attention.
    paged_prefill_attention_torch` for the layout) against their sequences' paged latents, expanded.
    Returns (N, heads, v_head_dim)."""
    out = q.new_empty(q.shape[0], q.shape[1], up.w_uv.shape[1])
    starts = list(query_start_host) if query_start_host is not None else query_start_loc.tolist()
    contexts = list(context_lens_host) if context_lens_host is not None else context_lens.tolist()
    for i, context in enumerate(contexts):
        start, end = starts[i], starts[i + 1]
        rows = gather_kv(cache, block_tables[i], context)[:, 0]
        out[start:end] = expanded_latent_attention(q[start:end], rows, scale, up)
    return out
