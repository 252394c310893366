"""The residual window of a KIVI cache (``kv_cache_dtype="int4"``): a filling block in full precision.

KIVI quantizes keys per channel, one scale per dimension over a block's tokens, so a block can only
become codes once all its tokens are there. Until then its tokens live in a *residual slot*: a
block-sized buffer of the model's dtype, one per sequence that has a partly filled last block (a step
that fills one block and starts the next hands the slot on, after sealing the full one).

The paged kernels need no second code path for it. Slots are numbered after the pool's blocks: in a
step's block tables (the copies handed to the kernels, never the requests' own), a sequence's partly
filled block ``b`` is replaced by ``num_blocks + slot``, and the cache views (:class:`WindowedLayerCache`)
read ids past the pool from the residual buffer. Each step's writes follow a plan made once by the
model runner (:class:`ResidualWindow`) and applied in every layer:

1. every new token of a partly filled block goes to its residual row;
2. blocks the step writes whole become codes straight away;
3. a block the step fills is *sealed*: its residual rows become codes and its slot is free, for the
   sequence's next filling block or another's;
4. the new filling blocks' tokens go to their rows, and the filling blocks are sealed too, as they
   stand, but keep their slot and are still read from it. So a block's codes are always a (lossy)
   picture of it, and another worker or a snapshot that copies blocks gets something to continue from.

A sequence whose partly filled block arrives without a residual slot (imported from a prefill worker,
restored from a snapshot) gets one by dequantizing those codes: its tail tokens went through int4 once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch

from minipd.kv.quant import QuantFormat, QuantizedLayerCache


class PagedKVPool(Protocol):
    """What the window needs of the paged pool that holds it (:class:`minipd.kv.paged_pool.PagedKVPool`,
    which imports this module: a protocol, so the two modules do not import each other)."""

    block_size: int
    num_blocks: int
    num_residual_slots: int
    k: Any
    residual_k: Any
    residual_v: Any
    step_plan: Any

    def thaw(self, slot: int, block_id: int, filled: int) -> None: ...


@dataclass
class ResidualPlan:
    """One step's writes into a windowed cache, as index tensors shared by every layer."""

    #: Tokens (rows of the step) that go to the residual window, and their rows there (``slot * bs + offset``):
    #: first those continuing a filling block, then (after the blocks they fill are sealed) those starting one.
    residual_tokens: torch.Tensor
    residual_rows: torch.Tensor
    tail_tokens: torch.Tensor
    tail_rows: torch.Tensor
    #: Tokens of blocks the step writes whole, ``block_size`` per block in order, and those blocks.
    direct_tokens: torch.Tensor
    direct_blocks: torch.Tensor
    #: Residual slots to seal into codes, the blocks they stand for, and how many of their rows are filled:
    #: first the blocks the step fills, then the filling blocks as they stand.
    seal_slots: torch.Tensor
    seal_blocks: torch.Tensor
    seal_counts: torch.Tensor
    partial_slots: torch.Tensor
    partial_blocks: torch.Tensor
    partial_counts: torch.Tensor


class WindowedLayerCache(QuantizedLayerCache):
    """One layer's K (or V) of a KIVI cache, read and written as if it held floats.

    Args:
        codes: ``(num_blocks, block_size, kv_heads, head_dim // 2)`` int4 codes, two to a byte.
        scales: fp16 scales, ``(num_blocks, kv_heads, head_dim)`` per channel (K) or
            ``(num_blocks, block_size, kv_heads)`` per token (V).
        residual: ``(num_slots, block_size, kv_heads, head_dim)`` full-precision rows of filling blocks.
        fmt: the code format.
        dtype: what reads return.
        per_channel: True for K.
        pool: where the step's :class:`ResidualPlan` is found.

    Its :attr:`shape` is the pool's; block ids past it name residual slots.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor, fmt: QuantFormat,
                 dtype: torch.dtype, per_channel: bool, pool: PagedKVPool) -> None:
        super().__init__(codes, scales, fmt, dtype)
        self.residual, self.per_channel, self.pool = residual, per_channel, pool
        self.num_blocks = codes.shape[0]

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Values of blocks given as their codes and scales (per channel for K)."""
        if self.per_channel:
            return self.fmt.dequantize_channels(codes, scales, self.dtype)
        return super().decode_blocks(codes, scales)

    def encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of whole blocks of values ``(n, block_size, heads, dim)``."""
        return self.fmt.quantize_channels(blocks) if self.per_channel else self.fmt.quantize(blocks)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` (any shape) as values: dequantized codes, or residual rows for ids past the pool."""
        real = index.clamp(max=self.num_blocks - 1)
        values = self.decode_blocks(self.codes[real], self.scales[real])
        in_window = index >= self.num_blocks
        if not bool(in_window.any()):
            return values
        rows = self.residual[(index - self.num_blocks).clamp(min=0)].to(self.dtype)
        return torch.where(in_window[..., None, None, None], rows, values)

    def store(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Write the step's ``x`` (N, kv_heads, head_dim) as the pool's step plan says (``slot_mapping`` is
        implied by it)."""
        plan = self.pool.step_plan
        if plan is None:
            raise RuntimeError("a KIVI cache (kv_cache_dtype='int4') is written through a step plan made by "
                               "ResidualWindow.plan; none is set")
        heads, dim = x.shape[-2:]
        bs = self.codes.shape[1]
        window = self.residual.view(-1, heads, dim)
        if plan.residual_tokens.numel():
            window[plan.residual_rows] = x[plan.residual_tokens].to(self.residual.dtype)
        if plan.direct_blocks.numel():
            codes, scales = self.encode_blocks(x[plan.direct_tokens].view(-1, bs, heads, dim))
            self.codes[plan.direct_blocks], self.scales[plan.direct_blocks] = codes, scales
        # Blocks filled this step are sealed before a new filling block may take over their slot.
        self._seal(plan.seal_slots, plan.seal_blocks, plan.seal_counts)
        if plan.tail_tokens.numel():
            window[plan.tail_rows] = x[plan.tail_tokens].to(self.residual.dtype)
        self._seal(plan.partial_slots, plan.partial_blocks, plan.partial_counts)

    def _seal(self, slots: torch.Tensor, blocks: torch.Tensor, counts: torch.Tensor) -> None:
        """Codes for ``blocks`` from the first ``counts`` rows of residual ``slots`` (the rest as zeros)."""
        if not slots.numel():
            return
        rows = self.residual[slots].float()
        filled = torch.arange(rows.shape[1], device=rows.device)[None, :] < counts[:, None]
        codes, scales = self.encode_blocks(rows * filled[:, :, None, None])
        self.codes[blocks], self.scales[blocks] = codes, scales


def _step_writes() -> SimpleNamespace:
    """An empty list for each field of :class:`ResidualPlan`: what a step's planning appends to."""
    return SimpleNamespace(**{f.name: [] for f in dataclasses.fields(ResidualPlan)})


class ResidualWindow:
    """Hands out residual slots to sequences' filling blocks and plans each step's writes.

    A slot belongs to (request, block id) while that block is the request's partly filled one. Slots
    are released when their block is sealed full; a request that finishes, is preempted or aborted
    simply stops using its slot, and the slot is reclaimed when one is next needed and none is free.
    """

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.num_blocks = pool.num_blocks
        self.free = list(range(pool.num_residual_slots - 1, -1, -1))
        self.owner: dict[int, tuple[Any, int]] = {}  # slot -> (request, block id)
        self.tail: dict[str, int] = {}  # request id -> slot of its filling block
        self._release: set[int] = set()
        self._writes = _step_writes()
        #: Slots filled from codes (a tail that arrived without its window), for tests and curiosity.
        self.num_thawed = 0

    @property
    def num_used_slots(self) -> int:
        """Slots held (some perhaps by requests that are gone, until reclaimed)."""
        return len(self.owner)

    def begin_step(self) -> None:
        """Start planning a step."""
        self._writes = _step_writes()

    def place(self, request: Any, table: list[int], first: int, count: int, first_row: int) -> tuple[
            np.ndarray, tuple[int, int] | None]:
        """Plan the writes of ``request``'s cache indices ``first .. first + count``, rows ``first_row ..``
        of the step.

        Returns each token's slot in the pool (ids past the pool's blocks address the residual window)
        and, when the request ends the step with a partly filled block, ``(table index, id)`` of the id
        its kernel block table must show in that block's place.
        """
        bs, w = self.block_size, self._writes
        end = first + count
        slots = np.empty(count, dtype=np.int64)
        cursor, tail, freed = first, None, None
        if first % bs:  # the step continues a filling block
            index = first // bs
            slot = self._slot_holding(request, table[index], first % bs)
            stop = min(end, (index + 1) * bs)
            self._to_window(slots, slot, first, stop, first, first_row, w.residual_tokens, w.residual_rows)
            if stop == (index + 1) * bs:  # ... and fills it: its slot is free for the next filling block
                w.seal_slots.append(slot)
                w.seal_blocks.append(table[index])
                w.seal_counts.append(bs)
                freed = slot
            else:
                self._seal_partial(slot, table[index], stop - index * bs)
                tail = (index, self.num_blocks + slot)
            cursor = stop
        whole_end = end // bs * bs
        if whole_end > cursor:  # blocks written whole in this step
            cache = np.arange(cursor, whole_end)
            blocks = np.asarray(table[cursor // bs:whole_end // bs], dtype=np.int64)
            slots[cursor - first:whole_end - first] = np.repeat(blocks, bs) * bs + cache % bs
            w.direct_tokens.extend(range(first_row + cursor - first, first_row + whole_end - first))
            w.direct_blocks.extend(blocks.tolist())
            cursor = whole_end
        if end > cursor:  # a new filling block (in the slot just freed, if any: sealing comes first)
            index = cursor // bs
            if freed is not None:
                slot, freed = freed, None
                self.owner[slot] = (request, table[index])
            else:
                slot = self._claim(request, table[index])
            self._to_window(slots, slot, cursor, end, first, first_row, w.tail_tokens, w.tail_rows)
            self._seal_partial(slot, table[index], end - cursor)
            tail = (index, self.num_blocks + slot)
        if freed is not None:
            self._release.add(freed)
            del self.tail[request.request_id]
        return slots, tail

    def plan(self) -> ResidualPlan:
        """The step's writes as device tensors; also set as the pool's ``step_plan``."""
        w, device = self._writes, self.pool.k.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        plan = ResidualPlan(**{name: tensor(values) for name, values in vars(w).items()})
        self.pool.step_plan = plan
        return plan

    def end_step(self) -> None:
        """Release the slots of blocks sealed full in the step (call it whether or not the step ran)."""
        for slot in self._release:
            self.owner.pop(slot, None)
            self.free.append(slot)
        self._release.clear()
        self.pool.step_plan = None

    def rows_of(self, request: Any, block_id: int, filled: int) -> torch.Tensor | None:
        """The exact rows of ``request``'s filling block ``block_id``, ``(2, layers, filled, heads, dim)``, or
        None when its window does not hold them."""
        slot = self.tail.get(request.request_id)
        holder = self.owner.get(slot) if slot is not None else None
        if holder is None or holder[0] is not request or holder[1] != block_id:
            return None
        pool = self.pool
        return torch.stack((pool.residual_k[:, slot, :filled], pool.residual_v[:, slot, :filled])).clone()

    def adopt(self, request: Any, block_id: int, rows: torch.Tensor) -> None:
        """Give ``request``'s filling block ``block_id`` a slot holding ``rows`` (from :meth:`rows_of`,
        perhaps in another process), so it continues in full precision."""
        slot = self._claim(request, block_id)
        filled = rows.shape[2]
        self.pool.residual_k[:, slot, :filled] = rows[0].to(self.pool.residual_k)
        self.pool.residual_v[:, slot, :filled] = rows[1].to(self.pool.residual_v)

    # ------------------------------------------------------------------------------------ internals
    def _to_window(self, slots: np.ndarray, slot: int, start: int, stop: int, first: int, first_row: int,
                   tokens: list[int], rows: list[int]) -> None:
        bs = self.block_size
        offsets = np.arange(start, stop) % bs
        slots[start - first:stop - first] = (self.num_blocks + slot) * bs + offsets
        tokens.extend(range(first_row + start - first, first_row + stop - first))
        rows.extend((slot * bs + offsets).tolist())

    def _seal_partial(self, slot: int, block_id: int, filled: int) -> None:
        w = self._writes
        w.partial_slots.append(slot)
        w.partial_blocks.append(block_id)
        w.partial_counts.append(filled)

    def _slot_holding(self, request: Any, block_id: int, filled: int) -> int:
        """The slot holding ``request``'s filling block, or a new one filled from the block's codes."""
        slot = self.tail.get(request.request_id)
        holder = self.owner.get(slot) if slot is not None else None
        if holder is not None and holder[0] is request and holder[1] == block_id:
            return slot  # type: ignore[return-value]
        slot = self._claim(request, block_id)
        self.pool.thaw(slot, block_id, filled)
        self.num_thawed += 1
        return slot

    def _claim(self, request: Any, block_id: int) -> int:
        old = self.tail.pop(request.request_id, None)
        if old is not None and old not in self._release:
            # From an earlier life of the request (preempted and recomputed, or its tail arrived as codes):
            # nothing reads it this step, so it can go straight back.
            self.owner.pop(old, None)
            self.free.append(old)
        if not self.free:
            self._reclaim()
        if not self.free:
            raise RuntimeError(f"all {self.pool.num_residual_slots} residual slots of the int4 KV cache are in "
                               "use; the engine sizes them for max_num_seqs")
        slot = self.free.pop()
        self.tail[request.request_id] = slot
        self.owner[slot] = (request, block_id)
        return slot

    def _reclaim(self) -> None:
        """Free slots whose request is gone or no longer has that block."""
        for slot, (request, block_id) in list(self.owner.items()):
            live = (not request.is_finished and self.tail.get(request.request_id) == slot
                    and block_id in request.blocks.block_table)
            if not live and slot not in self._release:
                del self.owner[slot]
                if self.tail.get(request.request_id) == slot:
                    del self.tail[request.request_id]
                self.free.append(slot)
