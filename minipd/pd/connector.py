"""The KV connector of a disaggregated worker, split as vLLM splits its KV connectors.

A worker's engine core knows nothing about other processes. What disaggregation adds to it sits in
two halves with a narrow interface between them, as in vLLM's ``KVConnectorBase_V1``:

- the **scheduler side** (:class:`KVConnectorScheduler`) decides about *blocks*: which requests'
  K/V come from elsewhere and when their blocks are ready to be filled, which finished requests keep
  their blocks for a reader and when those may be freed, which blocks are reserved for a writer and
  when a reservation may be given back;
- the **worker side** (:class:`KVConnectorWorker`) moves *bytes*: it starts loads, saves each layer
  as the model stores it, and reports which transfers finished, failed or were announced by a peer.

Neither sends a message: the worker loop (:mod:`minipd.pd.worker`) asks them and tells the front end.

How vLLM's methods map here:

=============================  ==============================================================
vLLM (``KVConnectorBase_V1``)   minipd
=============================  ==============================================================
get_num_new_matched_tokens      ``Request.num_external_tokens``, set by the front end
update_state_after_alloc        :meth:`KVConnectorScheduler.loads_ready`: blocks were allocated
request_finished (delay free)   :meth:`KVConnectorScheduler.hold` until a read or the lease ends
register_kv_caches              the transport registers the pool when it is made
start_load_kv                   :meth:`KVConnectorWorker.start_load_kv`
wait_for_layer_load             not needed: a decode starts once *all* its K/V are in
save_kv_layer                   :meth:`KVConnectorWorker.save_kv_layer` (the model's layer hook)
wait_for_save                   not blocking: saves finish in the background, ``get_finished`` says
get_finished                    :meth:`KVConnectorWorker.get_finished`
=============================  ==============================================================
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

#: The handle of a read lost on purpose (the ``"lose_reads"`` fault).
LOST = object()
#: A peer's notification that starts with this byte means "no more writes into that reservation will
#: come, and what was written must not be used".
GIVEN_UP = b"!"


@dataclass
class Load:
    """A decode-side request whose prompt K/V are read from a prefill worker's blocks."""

    peer: str
    remote_blocks: list[int]
    handle: Any = None
    started: float = 0.0
    num_bytes: int = 0


@dataclass
class Save:
    """A prefill-side request whose K/V this worker writes into a decode worker's reserved blocks."""

    peer: str
    remote_blocks: list[int]
    layerwise: bool
    next_block: int = 0  # first block not yet written in full (layer-wise)
    handles: list = field(default_factory=list)
    started: float = 0.0
    num_bytes: int = 0
    prefilled: bool = False  # the prefill is done (for "push": the one write is posted)
    failed: bool = False
    aborted: bool = False  # aborted here: finish the writes under way, then tell the reader
    compute_end: float = 0.0  # when the step that finished the prefill ended
    sends: list = field(default_factory=list)  # (layer or None, post start, post end) of each write


@dataclass
class FinishedTransfers:
    """What :meth:`KVConnectorWorker.get_finished` found since it was last asked."""

    #: Loads complete: request id -> (bytes, start, end).
    done_recving: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    #: Loads that failed or outlived their lease: request id -> why.
    failed_recving: dict[str, str] = field(default_factory=dict)
    #: Saves complete (every write acknowledged, the reader told): request id -> the Save.
    done_sending: dict[str, Save] = field(default_factory=dict)
    #: Saves that failed, or whose reader is gone: request id -> why.
    failed_sending: dict[str, str] = field(default_factory=dict)
    #: Saves of aborted requests whose writes are over (their blocks are already freed).
    dropped_sending: list[str] = field(default_factory=list)
    #: Peers' notifications: (request id, given up?). A reader's: "I have read your blocks"; a writer's:
    #: "my writes into your reservation are over" (given up: and must not be used).
    notes: list[tuple[str, bool]] = field(default_factory=list)


class KVConnectorWorker:
    """The worker side: starts loads, posts saves (layer by layer or whole), reports what finished.

    Args:
        transport: a registered transport (:mod:`minipd.pd.transport`).
        block_size: tokens per block.
        bytes_per_block: K and V of one block across every layer.
        num_layers: layers of the model.
        lease_s: how long a transfer may take before it counts as failed.
    """

    def __init__(self, transport: Any, block_size: int, bytes_per_block: int, num_layers: int,
                 lease_s: float) -> None:
        self.transport, self.block_size, self.lease_s = transport, block_size, lease_s
        self.bytes_per_block, self.num_layers = bytes_per_block, num_layers
        self.loads: dict[str, Load] = {}
        self.saves: dict[str, Save] = {}
        #: Faults injected on purpose: "lose_reads" makes every read vanish in flight.
        self.faults: set[str] = set()

    # ------------------------------------------------------------------------------ loads (pull)
    def start_load_kv(self, request_id: str, load: Load, local_blocks: list[int]) -> None:
        """Start reading ``load``'s remote blocks into ``local_blocks`` (the request's, just allocated)."""
        n = len(local_blocks)
        self.loads[request_id] = load
        load.started, load.num_bytes = time.perf_counter(), n * self.bytes_per_block
        if "lose_reads" in self.faults:  # the read is started, and never heard of again
            load.handle = LOST
            return
        load.handle = self.transport.start_read(load.peer, load.remote_blocks[:n], local_blocks,
                                                request_id.encode())

    def cancel_load(self, request_id: str) -> None:
        """Forget a load (its request was aborted); a read under way lands in blocks nobody reads."""
        self.loads.pop(request_id, None)

    # ------------------------------------------------------------------------- saves (push modes)
    def add_save(self, request_id: str, peer: str, remote_blocks: list[int], layerwise: bool) -> None:
        """Write this request's K/V into ``peer``'s ``remote_blocks``: layer by layer, or once prefilled."""
        self.saves[request_id] = Save(peer, list(remote_blocks), layerwise)

    def save_kv_layer(self, batch: Any, layer: int) -> None:
        """Layer ``layer`` of this step stored its K/V: post its blocks of the layer-wise saves in the batch,
        so they travel while the next layer computes."""
        if not self.saves:
            return
        bs = self.block_size
        last_layer = layer == self.num_layers - 1
        for request, n in batch.entries:
            save = self.saves.get(request.request_id)
            if save is None or not save.layerwise:
                continue
            # Blocks this step touched, and any before them not yet sent (a prefix-cache hit's blocks).
            end = min(-(-(request.num_computed_tokens + n) // bs), len(save.remote_blocks))
            table = request.blocks.block_table
            if end > save.next_block and not save.failed:
                posted = time.perf_counter()
                save.started = save.started or posted
                try:  # a failed write must not fail the forward pass of every other request
                    save.handles.append(self.transport.start_write(save.peer, table[save.next_block:end],
                                                                   save.remote_blocks[save.next_block:end], [layer]))
                except Exception:
                    save.failed = True
                    continue
                save.sends.append((layer, posted, time.perf_counter()))
                save.num_bytes += (end - save.next_block) * self.bytes_per_block // self.num_layers
            if last_layer:  # the partly filled last block is written again with the next chunk
                save.next_block = (request.num_computed_tokens + n) // bs

    def prefill_done(self, request_id: str, local_blocks: list[int]) -> None:
        """The request's prefill is complete; a ``"push"`` save writes all its blocks now, in one transfer."""
        save = self.saves[request_id]
        save.prefilled, save.compute_end = True, time.perf_counter()
        if save.layerwise:
            return
        n = min(len(local_blocks), len(save.remote_blocks))
        save.started = time.perf_counter()
        try:
            save.handles.append(self.transport.start_write(save.peer, local_blocks[:n], save.remote_blocks[:n]))
        except Exception:
            save.failed = True
        save.sends.append((None, save.started, time.perf_counter()))
        save.num_bytes = n * self.bytes_per_block

    def abort_save(self, request_id: str) -> None:
        """The request was aborted: finish the writes under way, then tell the reader to let go."""
        save = self.saves.get(request_id)
        if save is not None:
            save.aborted = True

    # ---------------------------------------------------------------------------------- progress
    def get_finished(self) -> FinishedTransfers:
        """Poll every transfer under way and the peers' notifications; report what ended."""
        finished = FinishedTransfers()
        now = time.perf_counter()
        for message in self.transport.notifications():
            given_up = message.startswith(GIVEN_UP)
            finished.notes.append(((message[1:] if given_up else message).decode(), given_up))
        for request_id, load in list(self.loads.items()):
            state = "PROC" if load.handle is LOST else self.transport.poll(load.handle)
            if state == "DONE":
                del self.loads[request_id]
                finished.done_recving[request_id] = (load.num_bytes, load.started, time.perf_counter())
            elif state == "ERR" or now - load.started > self.lease_s:
                del self.loads[request_id]
                finished.failed_recving[request_id] = f"transfer {state.lower()} after {now - load.started:.1f} s"
        for request_id, save in list(self.saves.items()):
            if not (save.prefilled or save.aborted):
                continue  # layer-wise writes may still be posted by later chunks
            states = [self.transport.poll(h) for h in save.handles]  # "ERR" when the reader is gone
            save.handles = [h for h, st in zip(save.handles, states, strict=True) if st == "PROC"]
            expired = now - (save.started or now) > self.lease_s
            failed = save.failed or "ERR" in states or expired
            if save.handles and not failed:
                continue
            del self.saves[request_id]
            if failed or save.aborted:
                with contextlib.suppress(Exception):  # a reader that is gone needs no word
                    self.transport.notify(save.peer, GIVEN_UP + request_id.encode())
                if save.aborted:
                    finished.dropped_sending.append(request_id)
                else:
                    finished.failed_sending[request_id] = "push failed"
                continue
            try:
                self.transport.notify(save.peer, request_id.encode())
            except Exception:  # the reader is gone: the front end recomputes the request
                finished.failed_sending[request_id] = "reader gone"
                continue
            finished.done_sending[request_id] = save
        return finished

    def notify(self, peer: str, request_id: str) -> None:
        """Tell ``peer`` its blocks for ``request_id`` need not be read (best effort: a gone peer frees by lease)."""
        with contextlib.suppress(Exception):
            self.transport.notify(peer, request_id.encode())


class KVConnectorScheduler:
    """The scheduler side: which blocks hold or receive K/V for another worker, and when they may be freed.

    Args:
        core: the worker's engine core (its ``reserve_blocks``, ``add_reserved``, ``release_kv``,
            ``finish_kv_load`` seams).
        lease_s: how long held blocks wait for a reader, and reservations for their writer.
    """

    def __init__(self, core: Any, lease_s: float) -> None:
        self.core, self.lease_s = core, lease_s
        #: Prefill side: finished requests whose blocks wait for a reader, and since when.
        self.held_since: dict[str, float] = {}
        #: Decode side (pull): requests admitted with their K/V elsewhere, until their load starts.
        self.pending_loads: dict[str, Load] = {}
        #: Decode side (push modes): reservations and since when; filled ones; ones whose writer gave
        #: up; ones the front end let go of while writes may still land (freed when the writer says its
        #: writes are over, so a late write never reaches blocks given to another request); requests
        #: waiting for their reservation to be filled.
        self.reserved_at: dict[str, float] = {}
        self.filled: set[str] = set()
        self.abandoned: set[str] = set()
        self.releasing: set[str] = set()
        self.adopt: dict[str, Any] = {}

    # ----------------------------------------------------------------------- prefill side (source)
    def hold(self, request_id: str) -> None:
        """A finished prefill keeps its blocks for a reader (vLLM's ``request_finished`` -> delay free)."""
        self.held_since[request_id] = time.monotonic()

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (read, or not wanted); False if it held none."""
        if self.held_since.pop(request_id, None) is None:
            return False
        self.core.release_kv(request_id)
        return True

    # --------------------------------------------------------------------------- decode side: pull
    def add_remote(self, request: Any, peer: str, remote_blocks: list[int]) -> None:
        """Admit a request whose first ``num_external_tokens`` tokens' K/V are in ``peer``'s blocks."""
        self.core.add_request(request)
        self.pending_loads[request.request_id] = Load(peer, list(remote_blocks))

    def loads_ready(self) -> tuple[dict[str, tuple[Load, list[int]]], dict[str, Load]]:
        """Loads whose blocks the scheduler just allocated (vLLM's ``update_state_after_alloc``), with the
        local blocks to fill; and loads not needed after all (the local prefix cache had the prompt)."""
        from minipd.engine.request import RequestStatus

        ready, unneeded = {}, {}
        for request_id in list(self.pending_loads):
            request = self.core.requests.get(request_id)
            if request is None:  # aborted
                del self.pending_loads[request_id]
            elif request.status is RequestStatus.RUNNING:
                unneeded[request_id] = self.pending_loads.pop(request_id)
            elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                n = -(-request.num_external_tokens // self.core.config.block_size)
                ready[request_id] = (self.pending_loads.pop(request_id), request.blocks.block_table[:n])
        return ready, unneeded

    def cancel(self, request_id: str) -> None:
        """The request was aborted: forget its pending load, any blocks it held for a reader, and a
        reservation it was to continue in (freed once writes into it that may be under way are over)."""
        self.pending_loads.pop(request_id, None)
        self.held_since.pop(request_id, None)
        if self.adopt.pop(request_id, None) is not None or request_id in self.reserved_at:
            self.release_reservation(request_id, writes_started=True)

    # --------------------------------------------------------------------- decode side: push modes
    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Set blocks aside for a writer; None when the pool has no room now."""
        blocks = self.core.reserve_blocks(request_id, num_tokens)
        if blocks is not None:
            self.reserved_at[request_id] = time.monotonic()
        return blocks

    def on_written(self, request_id: str, given_up: bool) -> None:
        """The writer's word that its writes into this reservation are over (given up: unusable)."""
        if request_id in self.releasing:  # the front end let go of it; now no write can land
            self.drop_reservation(request_id)
        elif request_id in self.reserved_at:
            (self.abandoned if given_up else self.filled).add(request_id)

    def release_reservation(self, request_id: str, writes_started: bool) -> None:
        """The front end lets go of a reservation; if writes into it may be under way, wait for their end."""
        if writes_started and request_id in self.reserved_at and \
                not (request_id in self.filled or request_id in self.abandoned):
            self.releasing.add(request_id)
        else:
            self.drop_reservation(request_id)

    def add_adopted(self, request: Any) -> None:
        """The request that continues in a reservation; it is admitted once the reservation is filled."""
        self.adopt[request.request_id] = request

    def admit_filled(self) -> dict[str, str]:
        """Admit every adopted request whose reservation is filled; returns the ones refused, with why."""
        refused = {}
        for request_id in [r for r in self.adopt if r in self.filled]:
            self.filled.discard(request_id)
            self.reserved_at.pop(request_id, None)
            try:
                self.core.add_reserved(self.adopt.pop(request_id), request_id)
            except ValueError as err:
                self.core.release_reservation(request_id)
                refused[request_id] = str(err)
        return refused

    def drop_reservation(self, request_id: str) -> None:
        """Give a reservation's blocks back and forget everything about it."""
        self.reserved_at.pop(request_id, None)
        for pending in (self.filled, self.abandoned, self.releasing):
            pending.discard(request_id)
        self.adopt.pop(request_id, None)
        self.core.release_reservation(request_id)

    # ------------------------------------------------------------------------------------ leases
    def expire(self) -> list[str]:
        """Free held blocks and unfilled reservations past their lease; returns the reservations expired."""
        now = time.monotonic()
        for request_id, since in list(self.held_since.items()):
            if now - since > self.lease_s:
                self.release(request_id)
        expired = [r for r, since in self.reserved_at.items() if now - since > self.lease_s and r not in self.filled]
        for request_id in expired:
            self.drop_reservation(request_id)
        return expired

    @property
    def watching(self) -> bool:
        """Whether something waits on a transfer or a lease (the worker loop polls sooner)."""
        return bool(self.pending_loads or self.reserved_at)
