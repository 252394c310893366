"""Token-budget eviction: keep each request's K/V within ``kv_budget`` by dropping what a press scores lowest.

After each step (its K/V written), every running request of the step that holds more than its budget
gives back its lowest-scored full blocks (``kv_eviction_granularity="block"``), or its lowest-scored
tokens, the kept ones compacted into fewer blocks (``"token"``). The press (:mod:`minipd.kv.press`)
decides what is least useful: by position (sink + window), key norm, received attention, or at random.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from minipd.engine.config import EngineConfig
from minipd.engine.request import Request, RequestStatus
from minipd.engine.scheduler import ScheduledBatch
from minipd.kv.press import AttentionTracker, blocks_to_drop
from minipd.kv.spec import KVSpec


class Evictor:
    """Applies ``press`` to a core's pool and block manager after each step."""

    def __init__(self, press: Any, config: EngineConfig, kv_spec: KVSpec, pool: Any, block_manager: Any) -> None:
        if kv_spec.latent and (press.needs_keys or press.needs_attention):
            # Known now, not at the first eviction: MLA's pool has no per-head keys to score or watch.
            raise ValueError(f"kv_eviction={type(press).__name__} scores per-head keys or the attention they "
                             "receive, but this model uses multi-head latent attention and its pool holds "
                             "compressed latents; use 'sink-window' or 'random', or no kv_eviction")
        self.press, self.config, self.kv_spec = press, config, kv_spec
        self.pool, self.block_manager = pool, block_manager
        #: What the attention-scoring presses read: each request's attention mass per cached token.
        self.tracker: AttentionTracker | None = None
        if press.needs_attention:
            self.tracker = AttentionTracker(config.block_size, getattr(press, "window", None))
        #: Blocks given back by the press so far, and with token-level eviction the tokens dropped.
        self.num_evicted_blocks = 0
        self.num_evicted_tokens = 0

    @property
    def attention_observer(self) -> Callable[..., None] | None:
        """What the model runner calls before each layer attends (``attention_observer``), or None when the
        press does not score by received attention."""
        return None if self.tracker is None else self.tracker.observe

    def evict(self, batch: ScheduledBatch, live: Iterable[str]) -> None:
        """Drop the lowest-scored full blocks of every request in the step that holds more than its budget
        (``live``: the ids of the live requests, whose attention records are kept)."""
        bs, budget = self.config.block_size, self.config.kv_budget
        if self.tracker is not None:
            self.tracker.forget(set(live))
        for request, _ in batch.entries:
            if request.status is not RequestStatus.RUNNING:
                continue
            alloc = request.blocks
            cached = request.num_computed_tokens - alloc.num_dropped_tokens
            if self.config.kv_eviction_granularity == "token":
                self._evict_tokens(request, cached)
                continue
            count = (cached - budget) // bs  # whole blocks only: up to a block over the budget is kept
            full = cached // bs
            if count < 1 or full < count:
                continue
            table = torch.tensor(alloc.block_table[:full], device=self.pool.k.device)
            firsts = alloc.block_positions(bs)[:full]
            context = {}
            if self.tracker is not None:
                context = {"attention": self.tracker.block_mass(request.request_id, firsts),
                           "num_prompt_tokens": request.num_prompt_tokens}
            keys = self.pool.keys(table) if self.press.needs_keys else self.pool.keys_shape(table)
            drop = blocks_to_drop(self.press, keys, firsts, request.num_computed_tokens, count, **context)
            self.block_manager.drop_blocks(alloc, drop, request.num_computed_tokens)
            self.num_evicted_blocks += len(drop)

    def _evict_tokens(self, request: Request, cached: int) -> None:
        """Token-level eviction: once a request holds a block's worth of tokens over its budget, drop the
        lowest-scored tokens down to the budget and compact the rest to the front of its blocks, so that
        whole blocks go back to the pool. The press scores tokens as blocks of one token each."""
        bs, budget, spec = self.config.block_size, self.config.kv_budget, self.kv_spec
        if cached - budget < bs:
            return
        alloc = request.blocks
        positions = alloc.cache_positions(bs, cached)
        shape = (cached, spec.num_layers, 1, spec.num_kv_heads, spec.head_dim)
        if self.press.needs_keys:
            blocks = torch.tensor(alloc.block_table[:-(-cached // bs)], device=self.pool.k.device)
            keys = self.pool.keys(blocks).transpose(1, 2).flatten(0, 1)[:cached].unsqueeze(2)  # tokens as blocks
        else:
            keys = torch.empty(shape, device="meta")
        context = {}
        if self.tracker is not None:
            context = {"attention": self.tracker.block_mass(request.request_id, positions, width=1),
                       "num_prompt_tokens": request.num_prompt_tokens}
        drop = set(blocks_to_drop(self.press, keys, positions, request.num_computed_tokens, cached - budget,
                                  **context))
        blocks_before = len(alloc.block_table)
        moves = self.block_manager.compact(alloc, [i for i in range(cached) if i not in drop], cached)
        if moves is None:
            return  # no free block to copy a shared one into: try again next step
        self.pool.move_slots(moves)
        self.num_evicted_blocks += blocks_before - len(alloc.block_table)
        self.num_evicted_tokens += len(drop)
