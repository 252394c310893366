"""A request in flight through a disaggregated cluster: its phase, where it is, and what it needs to be
resumed elsewhere (the cluster core's bookkeeping, kept apart from its routing and message handling)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from minipd.engine.request import EngineCoreOutput, Request
from minipd.pd.routing import Phase, check_transition


@dataclass
class Flight:
    """A request in flight: where it is and what it needs to be resumed elsewhere."""

    request: Request
    #: Tokens produced so far (what a recomputation elsewhere starts from, after the prompt).
    tokens: list[int] = field(default_factory=list)
    phase: Phase = Phase.QUEUED
    worker: str = ""
    prefill_tokens: int = 0
    cached_tokens: int = 0
    #: Push modes: the decode worker whose reserved blocks receive the prompt's K/V, and whether they have.
    dest: str = ""
    kv_done: bool = False
    mode: str = "pull"  # the kv_transfer in force when the request arrived
    held_back: bool = False  # it has waited in the backlog for decode room at least once
    #: Push modes: the decode worker's outputs, kept until the prefill worker's word on the transfer arrives (it
    #: comes on another socket than the decode worker's outputs), so that the transfer's metrics reach the
    #: request before any decode token does (a stop string found in one ends the request at once); and since when.
    parked: tuple[list[EngineCoreOutput], float] | None = None
    #: RequestMetrics fields the cluster knows (workers, KV transfer), sent with the next output when changed.
    route: dict[str, Any] = field(default_factory=dict)
    route_changed: bool = False

    def move(self, phase: Phase) -> None:
        self.phase = check_transition(self.phase, phase)

    def note(self, **fields: Any) -> None:
        self.route.update(fields)
        self.route_changed = True


class LiveRequests(Mapping[str, Request]):
    """The live requests of a cluster, by id (a view of its flights)."""

    def __init__(self, flights: dict[str, Flight]) -> None:
        self._flights = flights

    def __getitem__(self, request_id: str) -> Request:
        return self._flights[request_id].request

    def __iter__(self) -> Iterator[str]:
        return iter(self._flights)

    def __len__(self) -> int:
        return len(self._flights)


__all__ = ["Flight", "LiveRequests"]
