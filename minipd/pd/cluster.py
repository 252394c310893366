"""The disaggregated cluster as one engine core: requests in, token outputs out, workers behind it.

:class:`ClusterCore` speaks the same protocol as the colocated
:class:`~minipd.engine.core.EngineCore` (``add_request``, ``abort_requests``, ``step`` →
:class:`~minipd.engine.request.EngineCoreOutputs`; see :class:`~minipd.engine.front_end.CoreProtocol`),
so one front end serves both: detokenising, stop strings, EOS, seeds and logprobs happen once, in
:class:`~minipd.engine.front_end.FrontEnd`. Behind the protocol, each request moves through its
:class:`~minipd.pd.routing.Phase` across the workers of a :class:`~minipd.pd.processes.WorkerGroup`:

1. it goes to the prefill worker with the fewest requests in flight, which computes the prompt,
   samples the first token (with the request's own seed, token index 0) and keeps the prompt's
   blocks;
2. unless that token ends it, it goes on to the decode worker with the most free KV blocks, as a
   request whose prompt K/V are elsewhere (pushed layer by layer or at once into blocks reserved
   before the prefill, or pulled after it: ``kv_transfer``);
3. the decode worker samples every later token (token index 1 on), so the outputs are the ones a
   single engine gives, greedy or seeded.

A dead, silent or failed worker is fenced and its unfinished requests are sent elsewhere,
recomputed from the prompt and the tokens already produced; a transfer that never completes is
bounded by ``kv_lease_s``. Each worker's step records reach :attr:`ClusterCore.step_stats`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, Request
from minipd.engine.stats import StepStats
from minipd.engine.step_core import check_fits_pool, record_step
from minipd.errors import ParameterError
from minipd.outputs import KVTimeline
from minipd.pd import messages as m
from minipd.pd.flight import Flight, LiveRequests
from minipd.pd.processes import Worker, WorkerError, WorkerGroup
from minipd.pd.routing import Phase, Router, blocks_for

KV_TRANSFERS = ("pull", "push", "layerwise")
logger = logging.getLogger("minipd")


class ClusterCore:
    """An engine core whose steps run on prefill and decode workers.

    Args:
        workers: the started (or joined) workers.
        block_size, max_model_len: the workers' engine settings.
        kv_transfer: ``"pull"``, ``"push"`` or ``"layerwise"`` for requests added from now on.
        kv_lease_s: how long a final output waits for its transfer's report (and a read may take).
        router: the routing and backpressure policy.
        step_timeout: how long :meth:`step` waits for the workers' first message.
    """

    def __init__(self, workers: WorkerGroup, block_size: int, max_model_len: int, kv_transfer: str = "layerwise",
                 kv_lease_s: float = 30.0, router: Router | None = None, step_timeout: float = 0.05) -> None:
        self.workers = workers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_transfer = kv_transfer
        self.lease_s = kv_lease_s
        self.router = router or Router()
        self.step_timeout = step_timeout
        self._flights: dict[str, Flight] = {}
        self.requests: Mapping[str, Request] = LiveRequests(self._flights)
        self._backlog: list[Flight] = []
        self._outputs: list[EngineCoreOutput] = []
        #: Every worker step's record (``StepStats.worker`` names the worker), most recent last.
        self.step_stats: deque[StepStats] = deque(maxlen=10_000)
        #: Called with every worker step's record (metrics exporters).
        self.step_callbacks: list[Callable[[StepStats], None]] = []
        self.num_steps = 0
        #: Requests sent to another worker because theirs died or a K/V read failed.
        self.num_recovered_requests = 0
        #: Requests held back before prefill, at least once, because no decode worker had room (backpressure).
        self.num_backpressured = 0

    @property
    def kv_transfer(self) -> str:
        """How the K/V of requests added from now on move: ``"pull"``, ``"push"`` or ``"layerwise"``."""
        return self._kv_transfer

    @kv_transfer.setter
    def kv_transfer(self, mode: str) -> None:
        if mode not in KV_TRANSFERS:
            raise ParameterError("kv_transfer", f"kv_transfer must be one of {', '.join(map(repr, KV_TRANSFERS))}, "
                                                f"got {mode!r}")
        self._kv_transfer = mode

    # ------------------------------------------------------------------------- the core protocol
    def check_fits(self, num_tokens: int, max_tokens: int, what: str = "the request") -> None:
        """Refuse a request that could never fit the smallest worker pool, however long it waited."""
        smallest = min(w.num_blocks for w in self.workers.workers.values())
        check_fits_pool(num_tokens, max_tokens, self.max_model_len, self.block_size, smallest, what,
                        "the workers' pools have")

    def add_request(self, request: Request, kv: Any = None) -> None:
        """Route a new request (held back first when no decode worker would have room for it)."""
        if self.workers.closed:
            raise RuntimeError("this cluster is shut down")
        if kv is not None:
            raise ParameterError("kv", "a disaggregated cluster computes every prompt's K/V itself: pass kv=None")
        if request.request_id in self._flights:
            raise ParameterError("request_id", f"request_id {request.request_id!r} is already in use")
        # Routing asks which workers are alive; launched ones are judged by heartbeats that may have
        # waited unread while nobody stepped.
        self._pump(0.0)
        flight = Flight(request, mode=self._kv_transfer)
        self._flights[request.request_id] = flight
        if self._backlog or not self._decode_has_room(flight):
            # Backpressure: the prompt waits here (its TTFT grows) rather than piling up in a decode queue.
            self._hold_back(flight)
        else:
            self._to_prefill(flight)

    def abort_requests(self, request_ids: Iterable[str],
                       reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]:
        """End requests now, wherever they are (held back, prefilling, with K/V in transfer, decoding): the
        worker holding each frees its blocks. One final output for each that was live."""
        outputs = []
        for rid in request_ids:
            flight = self._flights.pop(rid, None)
            if flight is None:
                continue
            if flight in self._backlog:
                self._backlog.remove(flight)
            worker = self.workers.workers.get(flight.worker)
            if worker is not None:
                worker.requests.discard(rid)
                if worker.alive:
                    self._send_unless_dead(worker, m.Abort([rid], reason))
            dest = self.workers.workers.get(flight.dest)
            if dest is not None:
                dest.requests.discard(rid)
                if dest.alive and dest is not worker:
                    # Writes into its reservation may be under way: it is freed once they are over.
                    self._send_unless_dead(dest, m.ReleaseReservation(rid, flight.phase is not Phase.RESERVING))
            # Tokens kept back for a transfer report are dropped: an abort ends the request with what it was
            # handed, so a client that hung up is sent nothing more (vLLM's abort drops them too).
            flight.parked = None
            outputs.append(self._with_route(flight, EngineCoreOutput(rid, [], reason)))
        return outputs

    def step(self) -> EngineCoreOutputs:
        """Take what the workers sent (waiting up to ``step_timeout`` for it); the outputs it carried."""
        self._pump(self.step_timeout)
        outputs, self._outputs = self._outputs, []
        return EngineCoreOutputs(outputs, time.perf_counter())

    def take_failure(self) -> Exception | None:
        """Worker failures are recovered from here (requests go elsewhere): none is kept for the caller."""
        return None

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight or has an output not yet taken by :meth:`step`."""
        return bool(self._flights) or bool(self._outputs)

    # ----------------------------------------------------------------------------------- routing
    def _decode_has_room(self, flight: Flight) -> bool:
        """Whether some decode worker can take ``flight`` once prefilled, counting the prefills on their way."""
        # Prefills whose blocks are not reserved yet (push modes reserve, and free_blocks already counts
        # them) will each go where the router sends them.
        on_their_way = [self._blocks_for(f) for f in self._flights.values() if f.phase is Phase.PREFILL
                        and not f.dest]
        return self.router.decode_has_room(self.workers.role("decode"), on_their_way, self._blocks_for(flight))

    def _blocks_for(self, flight: Flight) -> int:
        return blocks_for(len(flight.request.all_token_ids), self.block_size)

    def _hold_back(self, flight: Flight, first: bool = False) -> None:
        """Put ``flight`` in the backlog (at its head when it was already admitted once)."""
        flight.move(Phase.QUEUED)
        flight.worker = ""
        if not flight.held_back:
            flight.held_back = True
            self.num_backpressured += 1
        self._backlog.insert(0 if first else len(self._backlog), flight)

    def _admit_backlog(self) -> None:
        while self._backlog and self._decode_has_room(self._backlog[0]):
            self._to_prefill(self._backlog.pop(0))

    def _to_prefill(self, flight: Flight) -> None:
        workers = self.workers.role("prefill")
        if not workers:
            return self._to_decode(flight, recompute=True)
        decoders = self.workers.role("decode")
        if flight.mode != "pull" and decoders:
            # Push modes: first reserve blocks on a decode worker, then prefill straight into them.
            dest = self.router.decode_worker(decoders)
            dest.free_blocks -= self._blocks_for(flight)
            flight.move(Phase.RESERVING)
            flight.dest, flight.kv_done = dest.name, False
            dest.requests.add(flight.request.request_id)
            self.workers.send(dest, m.Reserve(flight.request.request_id, len(flight.request.all_token_ids)))
            return None
        return self._prefill_on(flight, self.router.prefill_worker(workers))

    def _prefill_on(self, flight: Flight, worker: Worker, dest_blocks: list[int] | None = None) -> None:
        # The prefill worker samples only the first token, then keeps the prompt's K/V for the reader.
        request = flight.request
        first_only = dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=1),
                                         hold_kv=bool(self.workers.role("decode")),
                                         all_token_ids=list(request.all_token_ids))
        self._assign(flight, worker, Phase.PREFILL)
        if dest_blocks is None:
            self.workers.send(worker, m.AddRequest(first_only))
        else:
            self.workers.send(worker, m.AddPush(first_only, flight.dest, list(dest_blocks), flight.mode == "layerwise"))

    def _on_reserved(self, flight: Flight, blocks: list[int] | None) -> None:
        dest = self.workers.workers[flight.dest]
        dest.requests.discard(flight.request.request_id)
        workers = self.workers.role("prefill")
        if blocks is None or not workers:  # no room after all (or no prefill worker): wait, or go on without
            flight.dest = ""
            if blocks is not None:
                self._send_unless_dead(dest, m.ReleaseReservation(flight.request.request_id, False))
            if not workers:
                return self._to_decode(flight, recompute=True)
            self._hold_back(flight, first=True)
            return None
        return self._prefill_on(flight, self.router.prefill_worker(workers), blocks)

    def _to_decode(self, flight: Flight, recompute: bool, peer: str = "", blocks: Sequence[int] = ()) -> None:
        """Continue a request on a decode worker: reading its K/V from ``peer``, or recomputing its tokens."""
        if recompute:  # no transfer to wait for: anything still reported about one is stale
            flight.kv_done, flight.dest = True, ""
        prompt = flight.request.prompt_token_ids
        tokens = [*prompt, *flight.tokens]
        request = dataclasses.replace(flight.request, all_token_ids=tokens, hold_kv=False,
                                      num_external_tokens=0 if recompute else len(prompt))
        workers = self.workers.role("decode")
        if not workers:
            workers = self.workers.role("prefill")  # no decode worker left: a prefill worker decodes
            if not workers:
                raise WorkerError("every worker is gone")
            worker = self.router.prefill_worker(workers)
            self._assign(flight, worker, Phase.DECODE)
            self.workers.send(worker, m.AddRequest(dataclasses.replace(request, num_external_tokens=0)))
            return
        worker = self.router.decode_worker(workers)
        self._assign(flight, worker, Phase.DECODE)
        if recompute:
            self.workers.send(worker, m.AddRequest(request))
        else:
            # Reserve the blocks now, so the next request is not routed as if they were free.
            worker.free_blocks -= -(-len(tokens) // self.block_size)
            self.workers.send(worker, m.AddRemote(request, peer, list(blocks)))

    def _assign(self, flight: Flight, worker: Worker, phase: Phase) -> None:
        old = self.workers.workers.get(flight.worker)
        if old is not None:
            old.requests.discard(flight.request.request_id)
        flight.move(phase)
        flight.worker = worker.name
        worker.requests.add(flight.request.request_id)
        if phase is Phase.PREFILL:
            flight.note(prefill_worker=worker.name)
        else:
            flight.note(decode_worker=worker.name)

    # -------------------------------------------------------------------------------- the pump
    def _pump(self, timeout: float) -> None:
        """Take every message that has arrived (waiting up to ``timeout`` for the first); check for deaths."""
        message = self.workers.receive(timeout)
        while message is not None:
            self._on_message(message)
            message = self.workers.receive(0.0)
        for worker in list(self.workers.workers.values()):
            if not worker.fenced and not worker.alive:
                self._fence(worker, "its process exited" if worker.process is not None
                            and not worker.process.is_alive() else
                            f"it was silent for more than {self.workers.heartbeat_timeout:g} s")
        now = time.monotonic()
        for flight in [f for f in self._flights.values() if f.parked and now - f.parked[1] > self.lease_s]:
            self._unpark(flight)  # a report that never came must not hold the request back for ever
        self._admit_backlog()

    def _fence(self, worker: Worker, why: str) -> None:
        """Declare ``worker`` dead: never hear or route to it again, stop it, recover its requests elsewhere."""
        logger.warning("worker %s is taken for dead (%s); its requests go elsewhere", worker.name, why)
        self.workers.fence(worker)
        if worker.requests:
            self._on_death(worker)

    def _on_message(self, message: m.Message) -> None:
        if isinstance(message, (m.Heartbeat, m.Hello)):  # a heartbeat's news is its arrival; a late hello is not wanted
            return
        worker = self.workers.workers[message.worker]  # type: ignore[attr-defined]
        if isinstance(message, m.Outputs):
            worker.free_blocks = message.free_blocks
            for stats in message.stats:
                self._record(worker, stats)
            for request_id, timeline in message.timelines.items():
                flight = self._flights.get(request_id)
                if flight is not None:
                    flight.note(kv_timeline=KVTimeline(flight.mode, **timeline))
            for out in message.outputs.outputs:
                self._on_output(worker, out, message.held.get(out.request_id))
        elif isinstance(message, m.Reserved):
            flight = self._flights.get(message.request_id)
            if flight is None or flight.phase is not Phase.RESERVING:
                if message.blocks is not None:
                    self._send_unless_dead(worker, m.ReleaseReservation(message.request_id, False))
            else:
                self._on_reserved(flight, message.blocks)
        elif isinstance(message, m.KVLoaded):
            flight = self._flights.get(message.request_id)
            if flight is not None:
                self._on_kv_loaded(flight, message)
        elif isinstance(message, m.KVFailed):
            flight = self._flights.get(message.request_id)
            if flight is not None and flight.parked is not None:  # its decode worker ran: the K/V were there
                flight.kv_done = True
                self._unpark(flight)
            elif flight is not None and not flight.kv_done:
                flight.kv_done = True  # whatever else comes for this transfer is stale
                if flight.phase is Phase.DECODE:
                    self.num_recovered_requests += 1
                    dest = self.workers.workers.get(flight.dest)
                    if dest is not None and dest.alive:
                        self._send_unless_dead(dest, m.ReleaseReservation(flight.request.request_id, True))
                    flight.dest = ""
                    self._to_decode(flight, recompute=True)
        elif isinstance(message, m.Notice):
            logger.warning("%s: %s", message.worker, message.message)
        elif isinstance(message, m.Failure):
            flight = self._flights.pop(message.request_id, None) if message.request_id else None
            if flight is not None:
                self._finish_with_error(flight, message.message)
            elif not message.request_id:  # the worker's engine failed and the worker exits: recover as from a death
                self._fence(worker, f"it failed: {message.message.splitlines()[0] if message.message else ''}")

    def _on_kv_loaded(self, flight: Flight, message: m.KVLoaded) -> None:
        flight.kv_done = True
        route = flight.route
        fields: dict[str, Any] = {"kv_transfer_bytes": route.get("kv_transfer_bytes", 0) + message.bytes,
                                  "kv_transfer_start": message.start, "kv_transfer_end": message.end}
        if message.compute_end:  # pushed: how much of the transfer ran while the prefill computed
            span = max(message.end - message.start, 1e-9)
            fields["kv_transfer_hidden"] = min(1.0, max(0.0, (message.compute_end - message.start) / span))
        timeline = route.get("kv_timeline")
        if message.timeline is not None:  # pushed: the prefill worker measured it all
            timeline = KVTimeline(flight.mode, **message.timeline)
        if timeline is not None:
            timeline.transfer = (message.start, message.end)
            fields["kv_timeline"] = timeline
        flight.note(**fields)
        self._unpark(flight)

    def _on_output(self, worker: Worker, out: EngineCoreOutput, held: list[int] | None) -> None:
        if out.route is not None:  # (the cluster's to say, not a worker's)
            out = dataclasses.replace(out, route=None)
        flight = self._flights.get(out.request_id)
        if flight is None or flight.worker != worker.name:
            if held is not None:  # nobody will read these blocks any more
                self._send_unless_dead(worker, m.ReleaseKV(out.request_id))
            return
        if flight.phase is Phase.PREFILL and worker.role == "prefill" and out.finish_reason is FinishReason.LENGTH \
                and self._continues(flight, out):
            # The first token is in; decoding goes on elsewhere.
            flight.prefill_tokens, flight.cached_tokens = out.num_prefill_tokens, out.num_cached_tokens
            self._emit(flight, dataclasses.replace(out, finish_reason=None))
            if flight.dest and self.workers.workers[flight.dest].alive:
                self._adopt(flight)
            elif held is not None:
                self._to_decode(flight, recompute=False, peer=worker.name, blocks=held)
            else:
                self._to_decode(flight, recompute=True)
            return
        if flight.phase is Phase.PREFILL:
            self._let_go(flight, worker, held)
        elif held is not None:
            self._send_unless_dead(worker, m.ReleaseKV(out.request_id))
        out = dataclasses.replace(out, num_prefill_tokens=out.num_prefill_tokens + flight.prefill_tokens,
                                  num_cached_tokens=out.num_cached_tokens + flight.cached_tokens)
        prefill_worker = self.workers.workers.get(flight.route.get("prefill_worker") or "")
        if flight.dest and not flight.kv_done and prefill_worker is not None \
                and prefill_worker.alive:  # a push into this worker's reservation is still unreported
            if flight.parked is None:
                flight.parked = ([out], time.monotonic())
            else:
                flight.parked[0].append(out)
            return
        self._emit(flight, out)

    def _unpark(self, flight: Flight) -> None:
        """Deliver the outputs that waited for their transfer's report, in order."""
        if flight.parked is not None:
            parked, _ = flight.parked
            flight.parked = None
            for out in parked:
                self._emit(flight, out)

    def _adopt(self, flight: Flight) -> None:
        """Push modes: the decode worker takes the request into the blocks the prefill worker writes into."""
        dest = self.workers.workers.get(flight.dest)
        if dest is None or dest.fenced or not dest.alive:
            # The decode worker reserved for it died while it was prefilled: decode elsewhere, from its tokens.
            self.num_recovered_requests += 1
            flight.dest, flight.kv_done = "", True
            self._to_decode(flight, recompute=True)
            return
        prompt = flight.request.prompt_token_ids
        request = dataclasses.replace(flight.request, all_token_ids=[*prompt, *flight.tokens], hold_kv=False,
                                      num_external_tokens=len(prompt))
        self._assign(flight, dest, Phase.DECODE)
        self._send_unless_dead(dest, m.Adopt(request))  # the request is its now: a death since is recovered

    @staticmethod
    def _with_route(flight: Flight, out: EngineCoreOutput) -> EngineCoreOutput:
        """``out`` as the front end gets it: its tokens counted as the flight's, the route's news attached."""
        flight.tokens.extend(out.new_token_ids)
        if flight.route_changed:
            out = dataclasses.replace(out, route=dict(flight.route))
            flight.route_changed = False
        return out

    def _send_unless_dead(self, worker: Worker, message: m.Message) -> None:
        """Send ``message`` to ``worker``, which may have died since it was last seen alive. A dead worker keeps
        nothing more and the pump's check for deaths recovers its requests, so its send failing is not this step's
        error (a release sent to a decode worker killed a moment before once ended a whole run with WorkerError)."""
        try:
            self.workers.send(worker, message)
        except WorkerError:
            pass

    def _let_go(self, flight: Flight, worker: Worker, held: list[int] | None) -> None:
        """A request ended at its first token: free what was kept for its decode."""
        if held is not None:
            self._send_unless_dead(worker, m.ReleaseKV(flight.request.request_id))
        dest = self.workers.workers.get(flight.dest)
        if dest is not None and dest.alive:
            # Its K/V may still be on their way into the reservation: the decode worker frees it once
            # the prefill worker says its writes are over.
            self._send_unless_dead(dest, m.ReleaseReservation(flight.request.request_id, True))
        flight.dest = ""

    def _continues(self, flight: Flight, out: EngineCoreOutput) -> bool:
        """Whether a prefill that ended by length (its forced max_tokens=1) still has tokens to produce."""
        produced = len(flight.tokens) + len(out.new_token_ids)
        total = flight.request.num_prompt_tokens + produced
        return produced < flight.request.params.max_tokens and total < self.max_model_len

    def _emit(self, flight: Flight, out: EngineCoreOutput) -> None:
        """Hand ``out`` to the front end (at the next :meth:`step`), with the route's news."""
        out = self._with_route(flight, out)
        self._outputs.append(out)
        if out.finished:
            worker = self.workers.workers.get(flight.worker)
            if worker is not None:
                worker.requests.discard(flight.request.request_id)
            self._flights.pop(flight.request.request_id, None)

    def _on_death(self, worker: Worker) -> None:
        """Send the dead worker's unfinished requests elsewhere, recomputed from the tokens produced so far."""
        orphans = [f for rid, f in self._flights.items() if rid in worker.requests]  # in arrival order
        worker.requests.clear()
        for flight in [f for f in self._flights.values() if f.parked and f.route.get("prefill_worker") == worker.name]:
            self._unpark(flight)  # its transfer report will never come
        self.num_recovered_requests += len(orphans)
        for flight in orphans:
            dest = self.workers.workers.get(flight.dest)
            if flight.dest != worker.name and dest is not None and dest.alive:
                # Its prefill worker died: the decode worker's reservation will never be filled.
                self._send_unless_dead(dest, m.ReleaseReservation(flight.request.request_id, False))
            flight.dest, flight.kv_done = "", True
            if flight.phase in (Phase.PREFILL, Phase.RESERVING):
                self._to_prefill(flight)
            else:
                self._to_decode(flight, recompute=True)

    def _finish_with_error(self, flight: Flight, message: str) -> None:
        worker = self.workers.workers.get(flight.worker)
        if worker is not None:
            worker.requests.discard(flight.request.request_id)
        self._outputs.append(EngineCoreOutput(flight.request.request_id, [], FinishReason.ABORT, message))

    def _record(self, worker: Worker, stats: Any) -> None:
        if not isinstance(stats, StepStats):
            return
        self.num_steps += 1
        record_step(dataclasses.replace(stats, worker=worker.name), self.step_stats, self.step_callbacks)

    # ------------------------------------------------------------------------------ operations
    def inject_fault(self, worker: str, fault: str) -> None:
        """See :meth:`DisaggregatedLLM.inject_fault <minipd.pd.llm.DisaggregatedLLM.inject_fault>`."""
        if worker not in self.workers.workers:
            raise ParameterError("worker", f"worker must be one of {', '.join(self.workers.workers)}, got {worker!r}")
        self.workers.send(self.workers.workers[worker], m.InjectFault(fault))

    def worker_stats(self, timeout: float = 10.0) -> dict[str, dict]:
        """Each live worker's KV blocks used and free and its live requests (asked now)."""
        group = self.workers
        asked = {w.name for w in group.workers.values() if w.alive}
        for name in asked:
            group.send(group.workers[name], m.AskStats())
        stats: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while set(stats) != asked and time.monotonic() < deadline:
            message = group.receive(0.1)
            if message is None:
                continue
            if isinstance(message, m.Stats):
                stats[message.worker] = {"used_blocks": message.used_blocks, "free_blocks": message.free_blocks,
                                         "live_requests": message.live_requests}
            else:
                self._on_message(message)
        return stats


__all__ = ["KV_TRANSFERS", "ClusterCore"]
