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

The presses here: ``"sink-window"`` (StreamingLLM: the first block, where attention sinks live, and
the most recent ones), ``"knorm"`` (keep keys of small norm, which draw the most attention), and
``"random"`` (a control).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVPress(ABC):
    """Ranks a request's full blocks; the engine drops the lowest-scored ones beyond the budget."""

    name = "press"

    @abstractmethod
    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        """Importance of each block (higher is kept), shape ``(blocks,)``.

        Args:
            keys: the blocks' keys, dequantized: ``(blocks, layers, block_size, kv_heads, head_dim)``.
            first_positions: the position (in the request's tokens) of each block's first token.
            num_tokens: the request's tokens so far.
        """


class SinkWindowPress(KVPress):
    """StreamingLLM: keep the first block (its opening tokens soak up attention, "sinks") and the most
    recent blocks; drop from the oldest after the sinks."""

    name = "sink-window"

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

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def score(self, keys: torch.Tensor, first_positions: list[int], num_tokens: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + num_tokens)
        return torch.rand(len(first_positions), generator=generator)


PRESSES: dict[str, type[KVPress]] = {p.name: p for p in (SinkWindowPress, KNormPress, RandomPress)}


def make_press(press: str | KVPress) -> KVPress:
    """A press by name (one of :data:`PRESSES`), or the instance given."""
    if isinstance(press, KVPress):
        return press
    if press not in PRESSES:
        raise ValueError(f"kv_eviction must be one of {', '.join(map(repr, PRESSES))} or a KVPress instance, "
                         f"got {press!r}")
    return PRESSES[press]()


def blocks_to_drop(press: KVPress, keys: torch.Tensor, first_positions: list[int], num_tokens: int,
                   count: int) -> list[int]:
    """Indices (into the blocks given) of the ``count`` lowest-scored blocks, ties to the oldest."""
    scores = press.score(keys, first_positions, num_tokens)
    if scores.shape != (len(first_positions),):
        raise ValueError(f"{type(press).__name__}.score returned shape {tuple(scores.shape)}, expected "
                         f"({len(first_positions)},)")
    order = sorted(range(len(first_positions)), key=lambda i: (scores[i].item(), first_positions[i]))
    return sorted(order[:count])
