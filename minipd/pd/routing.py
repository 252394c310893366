"""Where a disaggregated request goes, and when it must wait: a pure policy, no sockets, no processes.

The cluster core (:mod:`minipd.pd.cluster`) asks it with the live workers' loads; a simulator can
ask it with simulated ones. A request's life is a :class:`Phase` with fixed transitions, so the
cluster core cannot put a request somewhere its life does not allow.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class Phase(enum.Enum):
    """Where a request of a disaggregated cluster is."""

    #: Held back by backpressure (no decode worker has room for it yet), or not routed yet.
    QUEUED = "queued"
    #: Push modes: a decode worker is reserving the blocks the prefill worker will write into.
    RESERVING = "reserving"
    #: On a prefill worker (which samples the first token).
    PREFILL = "prefill"
    #: On a decode worker (or, with none left, on a prefill worker that decodes).
    DECODE = "decode"


#: The moves a request may make. Recovery (a dead worker, a failed read) sends a prefill back to
#: prefill or reserving, and a decode to decode elsewhere; nothing goes back from decode to prefill.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.QUEUED, Phase.RESERVING, Phase.PREFILL, Phase.DECODE}),
    Phase.RESERVING: frozenset({Phase.QUEUED, Phase.RESERVING, Phase.PREFILL, Phase.DECODE}),
    Phase.PREFILL: frozenset({Phase.RESERVING, Phase.PREFILL, Phase.DECODE}),
    Phase.DECODE: frozenset({Phase.DECODE}),
}


def check_transition(old: Phase, new: Phase) -> Phase:
    """``new`` if a request may move there from ``old``; a RuntimeError (a bug in the caller) otherwise."""
    if new not in TRANSITIONS[old]:
        raise RuntimeError(f"a request cannot move from {old.value} to {new.value}")
    return new


class WorkerLoad(Protocol):
    """What routing needs to know of a worker."""

    name: str
    #: KV blocks it has free, less those promised to requests on their way to it.
    free_blocks: int

    @property
    def num_requests(self) -> int: ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a request of ``num_tokens`` tokens needs on its decode worker (with room for the next token)."""
    return -(-(num_tokens + 1) // block_size)


class Router:
    """Least-loaded routing with backpressure.

    - a prefill goes to the prefill worker with the fewest requests (prefill time grows with the queue);
    - a decode goes to the decode worker with the most free KV blocks (decode is bounded by memory);
    - a new prompt is held back, before its prefill, while no decode worker would have room for it once
      the prefills already on their way there have landed (its TTFT grows instead of a decode queue).
    """

    def prefill_worker(self, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        """The prefill worker for a new prompt (``workers`` must not be empty)."""
        return min(workers, key=lambda w: w.num_requests)

    def decode_worker(self, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        """The decode worker for a prefilled request (``workers`` must not be empty)."""
        return max(workers, key=lambda w: w.free_blocks)

    def decode_has_room(self, decoders: Sequence[WorkerLoad], on_their_way: Sequence[int], needed: int) -> bool:
        """Whether some decode worker can take a request needing ``needed`` blocks once prefilled, given the
        blocks ``on_their_way`` of prefills under way whose decode worker is not chosen yet (each will go
        where the room is largest at the time). With no decode worker, the prefill workers decode: yes."""
        if not decoders:
            return True
        room = [w.free_blocks for w in decoders]
        for blocks in on_their_way:
            room[room.index(max(room))] -= blocks
        return max(room) >= needed
