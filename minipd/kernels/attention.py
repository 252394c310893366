"""Causal scaled-dot-product attention of new queries against all cached keys and values: the torch
reference every attention kernel is checked against, and what the paged references gather into.

Layers call :func:`attention` (through :mod:`minipd.layers.attention`) when there is no cache, and
otherwise hand q, k and v to the cache's ``attend``: a contiguous cache appends and calls
:func:`attention`, the paged cache stores K/V into its blocks and runs the paged kernels of the chosen
backend. The mask lives here, below the layers, so that a kernel never reaches up into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(num_queries: int, num_keys: int, sliding_window: int | None = None,
                device: torch.device | None = None) -> torch.Tensor:
    """Boolean (queries, keys) mask, True where a query may look.

    The queries are the last ``num_queries`` of ``num_keys`` positions, so query ``i`` sits at
    position ``num_keys - num_queries + i`` and sees every key at or before it (and, with a sliding
    window, only the ``sliding_window`` most recent of those).
    """
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              sliding_window: int | None = None) -> torch.Tensor:
    """Attend ``q`` (T, Hq, D) to ``k``, ``v`` (S, Hkv, D); the queries are the last T of S positions.

    Grouped-query attention: each of the Hkv key/value heads serves Hq / Hkv query heads, which
    ``enable_gqa`` handles without materialising repeated K/V. Returns (T, Hq, D).
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    window_matters = sliding_window is not None and num_keys > sliding_window
    q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if num_queries == num_keys and not window_matters:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True)
    elif num_queries == 1 and not window_matters:
        out = F.scaled_dot_product_attention(q_, k_, v_, scale=scale, enable_gqa=True)
    else:
        mask = causal_mask(num_queries, num_keys, sliding_window, q.device)
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
