"""The messages between a disaggregated front end and its prefill/decode workers (typed, see :mod:`minipd.messages`).

Commands go from the front end to one worker's inbox; reports come from every worker to the front
end's outbox, each naming its ``worker``. A report is built without it and stamped by the worker's
send (:func:`stamped`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from minipd.engine.request import EngineCoreOutputs, FinishReason, Request
from minipd.messages import Message


# ------------------------------------------------------------------------------ front end → worker
@dataclasses.dataclass(frozen=True)
class AddRequest(Message):
    """Compute ``request`` here (a prefill samples its first token; a decode continues it)."""

    request: Request


@dataclasses.dataclass(frozen=True)
class AddRemote(Message):
    """Pull: continue ``request`` once its prompt's K/V are read from ``peer``'s blocks ``blocks``."""

    request: Request
    peer: str
    blocks: list[int]


@dataclasses.dataclass(frozen=True)
class AddPush(Message):
    """Push: prefill ``request`` and write its K/V into ``peer``'s reserved ``blocks`` (layer by layer or at once)."""

    request: Request
    peer: str
    blocks: list[int]
    layerwise: bool


@dataclasses.dataclass(frozen=True)
class Abort(Message):
    """End these requests now (``STOP``: a stop string ended them in the front end)."""

    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


@dataclasses.dataclass(frozen=True)
class ReleaseKV(Message):
    """Free the blocks kept for a reader of ``request_id`` (nobody will read them)."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class Reserve(Message):
    """Push modes: set aside blocks for ``num_tokens`` tokens of ``request_id``'s prompt."""

    request_id: str
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Adopt(Message):
    """Push modes: continue ``request`` in the blocks reserved for it, once its K/V are written."""

    request: Request


@dataclasses.dataclass(frozen=True)
class ReleaseReservation(Message):
    """Give back ``request_id``'s reservation (``after_writes``: once writes under way into it are over)."""

    request_id: str
    after_writes: bool


@dataclasses.dataclass(frozen=True)
class AddPeer(Message):
    """How to reach another worker's KV memory (its transport's ``peer_info()``)."""

    peer: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class InjectFault(Message):
    """Misbehave on purpose (``"lose_reads"``, ``"slow_writes"``, ``"late_reports"``)."""

    fault: str


@dataclasses.dataclass(frozen=True)
class AskStats(Message):
    """Report blocks used and free and live requests (a :class:`Stats`)."""


@dataclasses.dataclass(frozen=True)
class Shutdown(Message):
    """Stop serving and exit."""


@dataclasses.dataclass(frozen=True)
class Configure(Message):
    """To a launched worker that said hello: who it is, the model and engine options, and the KV transport."""

    name: str
    model: str
    llm_options: dict[str, Any]
    kv_lease_s: float
    threads: int | None
    transport: dict[str, Any]


# ------------------------------------------------------------------------------ worker → front end
@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """A launched worker introduces itself (its inbox, and a free port should it host torch's store)."""

    role: str
    inbox: str
    host: str
    free_port: int
    pid: int
    torchrun: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Ready(Message):
    """The worker loaded its engine and transport."""

    pid: int
    peer: dict[str, Any]
    num_kv_blocks: int
    kv_spec: dict[str, Any]
    engine: dict[str, str]
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Outputs(Message):
    """A step's (or an abort's) outputs, the blocks of prefills that hold their K/V for a reader, the
    prefills' layer timelines, the blocks free, and the step's record."""

    outputs: EngineCoreOutputs
    held: dict[str, list[int]]
    timelines: dict[str, dict[str, Any]]
    free_blocks: int
    stats: list[Any]
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Reserved(Message):
    """The blocks reserved for ``request_id`` (None: no room now)."""

    request_id: str
    blocks: list[int] | None
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class KVLoaded(Message):
    """``request_id``'s K/V arrived (read, or written by the prefill worker): bytes, start and end times;
    pushes add when the prefill's compute ended and its layer timeline."""

    request_id: str
    bytes: int
    start: float
    end: float
    compute_end: float | None = None
    timeline: dict[str, Any] | None = None
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class KVFailed(Message):
    """``request_id``'s K/V never arrived (a lost read, an expired lease): recompute it."""

    request_id: str
    message: str
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Notice(Message):
    """Something failed that the worker survived (logged by the front end)."""

    message: str
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Failure(Message):
    """A request failed here (``request_id``), or, without one, the worker itself did and is exiting."""

    message: str
    request_id: str | None = None
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    """Still here (sent at least every second while idle)."""

    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Stats(Message):
    """Blocks used and free, and live requests (the answer to :class:`AskStats`)."""

    used_blocks: int
    free_blocks: int
    live_requests: int
    worker: str = ""


#: Every message of this protocol (for :data:`minipd.wire.ALLOWED` and the round-trip tests).
MESSAGES = (AddRequest, AddRemote, AddPush, Abort, ReleaseKV, Reserve, Adopt, ReleaseReservation, AddPeer,
            InjectFault, AskStats, Shutdown, Configure, Hello, Ready, Outputs, Reserved, KVLoaded, KVFailed, Notice,
            Failure, Heartbeat, Stats)

Report = TypeVar("Report", bound=Message)


def stamped(report: Report, worker: str) -> Report:
    """``report`` with the sending worker's name."""
    return dataclasses.replace(report, worker=worker)  # type: ignore[call-arg]
