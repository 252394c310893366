"""Token eviction on the paged pool: "presses" that keep a request's K/V within a budget.

Once a request holds more than ``kv_budget`` tokens of K/V, the engine asks its press to rank the
request's full blocks and drops the least important ones, whole blocks at a time, back to the pool
(:meth:`~minipd.kv.block_manager.BlockManager.drop_blocks`). Positions stay right: RoPE was applied
to the keys before they were cached, so a kept key remembers where it came from, and the model
runner computes each new token's true position. A block shared through the prefix cache is only
released by this request, never written, so other readers see the same bytes.

A press only scores blocks; writing one is a few lines::

    class LargestValuesFirst(KVPress):
        name = "largest-values"

        def score(self, keys, first_positions, num_tokens):
            return keys.abs().amax(dim=(1, 2, 3, 4))  # keep the blocks with the largest keys

With ``kv_eviction_granularity="token"`` the same presses rank single tokens (each passed as a block of
one token): once a request is a block over its budget, the lowest-scored tokens go and the rest are
compacted to the front of its blocks, so whole blocks return to the pool.

The presses here: ``"sink-window"`` (StreamingLLM: the first block, where attention sinks live, and
the most recent ones), ``"knorm"`` (keep keys of small norm, which draw the most attention),
``"h2o"`` (heavy hitters: the blocks that have received the most attention so far, and the newest),
``"snapkv"`` (the prompt blocks its last queries attend to most; generated blocks by recency) and
``"random"`` (a control). The two attention-based presses set ``needs_attention``: the engine then
watches every layer's attention (:class:`AttentionTracker`, extra work each step) and passes each
block's share to ``score``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class KVPress(ABC):
    """Ranks a request's full blocks; the engine drops the lowest-scored ones beyond the budget."""

    name = "press"
    #: True: ``score`` also receives ``attention``, each block's share of the attention observed.
    needs_attention = False
    #: False: ``score`` never reads the keys' values, so the engine skips dequantizing every layer's keys
    #: and passes a ``meta`` tensor of the same shape (its shape can be read, its values cannot).
    needs_keys = True

    @abstractmethod
    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        """Importance of each block (higher is kept), shape ``(blocks,)``.

        Args:
            keys: the blocks' keys, dequantized: ``(blocks, layers, block_size, kv_heads, head_dim)``.
            first_positions: the position (in the request's tokens) of each block's first token.
            num_tokens: the request's tokens so far.

        A press with ``needs_attention`` gets ``attention=`` too: ``(blocks,)``, the attention the
        blocks' tokens received, summed over the queries it watches, heads and layers.
        """


class SinkWindowPress(KVPress):
    """StreamingLLM: keep the first block (its opening tokens soak up attention, "sinks") and the most
    recent blocks; drop from the oldest after the sinks."""

    name = "sink-window"
    needs_keys = False

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        scores = torch.tensor(first_positions, dtype=torch.float32)
        scores[torch.tensor(first_positions) == 0] = float("inf")
        return scores


class KNormPress(KVPress):
    """Keep blocks whose keys have a small L2 norm: such keys tend to receive the most attention
    (Devoto et al., 2024), so the largest-norm blocks go first."""

    name = "knorm"

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        return -keys.float().norm(dim=-1).mean(dim=(1, 2, 3))


class RandomPress(KVPress):
    """Drop blocks at random (the same blocks for the same request and length): the control."""

    name = "random"
    needs_keys = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + num_tokens)
        return torch.rand(len(first_positions), generator=generator)


class H2OPress(KVPress):
    """Heavy hitters (H2O, Zhang et al., 2023): keep the blocks whose tokens received the most attention
    from every query so far, and the ``recent`` newest tokens (at least the newest block), which have not
    yet had time to collect any. At token granularity the recent window matters: without it, old tokens
    (seen by more queries) crowd out the local context."""

    name = "h2o"
    needs_attention = True
    needs_keys = False

    def __init__(self, recent: int = 16) -> None:
        self.recent = recent

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int, *,
              attention: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        scores = attention.clone() if attention is not None else torch.zeros(len(first_positions))
        newest = sorted(range(len(first_positions)), key=first_positions.__getitem__)
        for i in newest[-max(1, self.recent // keys.shape[2]):]:  # keys.shape[2]: tokens per ranked item
            scores[i] = float("inf")
        return scores


class SnapKVPress(KVPress):
    """SnapKV (Li et al., 2024): the prompt's last ``window`` queries (the "observation window") show
    which prompt tokens matter; keep the prompt blocks they attend to most. Generated blocks are
    ranked by recency, after every prompt block."""

    name = "snapkv"
    needs_keys = False
    needs_attention = True

    def __init__(self, window: int = 16) -> None:
        self.window = window

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int, *,
              attention: torch.Tensor | None = None, num_prompt_tokens: int | None = None, **_: Any) -> torch.Tensor:
        scores = attention.clone() if attention is not None else torch.zeros(len(first_positions))
        prompt_end = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        for i, first in enumerate(first_positions):
            if first + keys.shape[2] > prompt_end:  # holds generated tokens (or the prompt's tail)
                scores[i] = 1e30 + first
        return scores


class AttentionTracker:
    """Accumulates, per request and token position, the attention that token has received.

    Installed as the model runner's ``attention_observer``: before each layer attends, it recomputes
    the softmax of the queries it watches against the request's cached keys (the reference's own
    arithmetic, so it costs about one more attention per watched query). ``window``: watch only each
    prompt's last ``window`` queries (SnapKV); None: every query (H2O).
    """

    def __init__(self, block_size: int, window: int | None = None) -> None:
        self.block_size, self.window = block_size, window
        self.received: dict[str, torch.Tensor] = {}

    def observe(self, batch: Any, layer: int, q: torch.Tensor, k_cache: Any, scale: float) -> None:
        """Add this layer's attention of the batch's watched queries to the tokens they attend to."""
        bs = self.block_size
        decodes = [(r, n) for r, n in batch.entries if n == 1]  # the runner's row order: one-query rows first
        row = 0
        for request, n in decodes + [(r, n) for r, n in batch.entries if n > 1]:
            rows, row = slice(row, row + n), row + n
            start = first = request.num_computed_tokens
            end = start + n
            if self.window is not None:  # only the prompt's last queries
                first, end = max(start, request.num_prompt_tokens - self.window), min(end, request.num_prompt_tokens)
            if first >= end:
                continue
            cached = start - request.blocks.num_dropped_tokens + n
            table = torch.tensor(request.blocks.block_table[:-(-cached // bs)], device=q.device)
            keys = k_cache[table].flatten(0, 1)[:cached].float()  # (cached, kv_heads, dim)
            positions = torch.tensor(request.blocks.cache_positions(bs, cached))
            queries = q[rows][first - start:end - start].float()
            q_pos = torch.arange(first, end)
            group = queries.shape[1] // keys.shape[1]
            logits = torch.einsum("qhd,khd->hqk", queries, keys.repeat_interleave(group, dim=1)) * scale
            logits = logits.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
            mass = logits.softmax(dim=-1).sum(dim=(0, 1))
            total = self.received.setdefault(request.request_id, torch.zeros(0))
            if total.numel() <= int(positions.max()):
                total = torch.cat([total, torch.zeros(int(positions.max()) + 1 - total.numel())])
            total.index_add_(0, positions, mass.cpu())
            self.received[request.request_id] = total

    def block_mass(self, request_id: str, first_positions: list[int], width: int | None = None) -> torch.Tensor:
        """The attention received by the ``width`` tokens (a block's by default) from each of ``first_positions``."""
        width = self.block_size if width is None else width
        total = self.received.get(request_id, torch.zeros(0))
        padded = torch.cat([total, torch.zeros(max(0, max(first_positions) + width - total.numel()))])
        if width == 1:
            return padded[torch.tensor(first_positions, dtype=torch.long)].clone()
        return torch.stack([padded[f:f + width].sum() for f in first_positions])

    def forget(self, keep: set[str]) -> None:
        """Drop what was kept for requests not in ``keep`` (finished, aborted)."""
        for request_id in [r for r in self.received if r not in keep]:
            del self.received[request_id]


PRESSES: dict[str, type[KVPress]] = {p.name: p for p in (SinkWindowPress, KNormPress, H2OPress, SnapKVPress,
                                                          RandomPress)}


def make_press(press: str | KVPress) -> KVPress:
    """A press by name (one of :data:`PRESSES`), or the instance given."""
    if isinstance(press, KVPress):
        return press
    if press not in PRESSES:
        raise ValueError(f"kv_eviction must be one of {', '.join(map(repr, PRESSES))} or a KVPress instance, "
                         f"got {press!r}")
    return PRESSES[press]()


def blocks_to_drop(press: KVPress, keys: torch.Tensor, first_positions: list[int], num_tokens: int,
                   count: int, **context: Any) -> list[int]:
    """Indices (into the blocks given) of the ``count`` lowest-scored blocks, ties to the oldest.

    ``context`` (``attention=``, ``num_prompt_tokens=``) reaches presses with ``needs_attention``."""
    scores = press.score(keys, first_positions, num_tokens, **context) if press.needs_attention else \
        press.score(keys, first_positions, num_tokens)
    if scores.shape != (len(first_positions),):
        raise ValueError(f"{type(press).__name__}.score returned shape {tuple(scores.shape)}, expected "
                         f"({len(first_positions)},)")
    order = sorted(range(len(first_positions)), key=lambda i: (scores[i].item(), first_positions[i]))
    return sorted(order[:count])
