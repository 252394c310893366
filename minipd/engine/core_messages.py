"""The messages between a :class:`~minipd.engine.core_client.CoreClient` and its engine core loop
(typed, see :mod:`minipd.messages`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from minipd.engine.request import FinishReason, Request
from minipd.kv.paged_pool import PackedKV
from minipd.messages import Message


# ------------------------------------------------------------------------------------ client → core
@dataclasses.dataclass(frozen=True)
class AddRequest(Message):
    """Queue ``request`` (with its first ``num_external_tokens`` tokens' K/V, when given)."""

    request: Request
    kv: PackedKV | None = None


@dataclasses.dataclass(frozen=True)
class AbortRequests(Message):
    """End these requests now; each live one comes back once more with finish reason ``reason``."""

    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


@dataclasses.dataclass(frozen=True)
class ImportKV(Message):
    """The K/V a request added with ``num_external_tokens`` waits for."""

    request_id: str
    kv: PackedKV


@dataclasses.dataclass(frozen=True)
class FinishKVLoad(Message):
    """A transport wrote the request's K/V into its blocks directly."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class ExportKV(Message):
    """Send back a request's K/V (its first ``num_tokens`` tokens; all computed ones by default)."""

    request_id: str
    num_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class ReleaseKV(Message):
    """Free the blocks a finished ``hold_kv`` request kept."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class Shutdown(Message):
    """Stop the loop."""


# ------------------------------------------------------------------------------------ core → client
@dataclasses.dataclass(frozen=True)
class CoreReady(Message):
    """The core process loaded its model: what a client needs to know of its engine."""

    pid: int
    kv_spec: dict[str, Any]
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: list[int]


@dataclasses.dataclass
class CoreError:
    """A message from the core loop: something it was asked failed (the loop keeps running)."""

    request_id: str | None
    message: str


@dataclasses.dataclass
class ExportedKV:
    """The core loop's answer to :class:`ExportKV`."""

    request_id: str
    kv: PackedKV


#: Every message of this protocol (for the round-trip tests).
MESSAGES = (AddRequest, AbortRequests, ImportKV, FinishKVLoad, ExportKV, ReleaseKV, Shutdown, CoreReady, CoreError,
            ExportedKV)
