"""A cluster of simulated instances on :mod:`simpy`: arrivals, a router, colocated or disaggregated
instances, KV transfers over a link, and what every request saw.

Why simpy: it is the discrete-event library DistServe's simulator uses, small and well known, and its
processes (generators that ``yield`` timeouts and events) read like the loops they model: an arrival
process, one loop per instance (:class:`~minipd.sim.instance.SimInstance`), one process per KV transfer.

Routing is :class:`minipd.pd.routing.Router`, the policy :class:`~minipd.pd.DisaggregatedLLM`'s cluster
core asks (or one given in :attr:`ClusterSpec.router`), asked here with the simulated instances' loads.

**Colocated**: each request goes to the instance with the fewest requests (the router's least-loaded
rule); prefill and decode share its steps (the scheduling policy and chunk budget are the instance's).

**Disaggregated**: a new prompt is held back (backpressure) while no decode instance would have room for it
once the prefills already under way have landed, as the real cluster does. Then it is prefilled on the
prefill instance with the fewest requests, which emits its first token and keeps its K/V (``hold_kv``),
and continues on the decode instance with the most free KV blocks. The decode instance's scheduler admits
it when it can allocate the blocks; then the K/V cross the prefill instance's link (one transfer at a time,
each ``latency + bytes / bandwidth``)
and the request decodes from its second token. With ``layerwise``, layers are sent while the prefill
computes the next ones: the part of the transfer that fits in the prefill's last step is hidden, at
least one layer's share never is (an approximation: it assumes the decode blocks were ready when the
prefill began, as push mode arranges, and ignores that they were not).

**Control messages** between processes take time (:attr:`ClusterSpec.dispatch_latency_s`,
:attr:`ClusterSpec.output_latency_s`; 0 by default, as for an engine in the client's process): a request
reaches its first instance that long after it arrives, every output reaches the client that long after its
step, and a request moves on to its decode instance after both (the front end hears of the first token,
then routes it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minipd.engine.request import EngineCoreOutputs, Request
from minipd.errors import ParameterError
from minipd.pd.routing import Router, blocks_for
from minipd.sampling_params import SamplingParams
from minipd.serve.loadgen import RequestResult, Slo, attainment_share, summarize
from minipd.serve.workload import PlannedRequest
from minipd.sim.instance import SIM_TOKEN, InstanceConfig, InstanceStats, SimInstance, StepTimeModel

if TYPE_CHECKING:
    from minipd.sim.roofline import Link


@dataclass(frozen=True)
class InstanceSpec:
    """``count`` identical instances of one role."""

    role: str
    model: StepTimeModel
    config: InstanceConfig
    count: int = 1
    #: Devices each instance spans (its tensor-parallel degree), for goodput per device.
    devices: int = 1
    #: Instances sharing one machine's cores (:mod:`minipd.sim.sharing`): σ, how much slower each step of these
    #: instances computes per other instance mid-step (a step wholly beside one other takes ``1 + σ`` times its
    #: time alone). 0 for instances on devices of their own; when any instance of a cluster has one, all its
    #: instances share the cores.
    sharing_slowdown: float = 0.0

    def __post_init__(self) -> None:
        if self.count < 1 or self.devices < 1:
            raise ValueError(f"count and devices must be >= 1, got {self.count} and {self.devices}")
        if not (math.isfinite(self.sharing_slowdown) and self.sharing_slowdown >= 0):
            raise ValueError(f"sharing_slowdown must be a finite number >= 0, got {self.sharing_slowdown!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """What runs: the instances, and for a disaggregated cluster the K/V that move and the link they cross."""

    instances: tuple[InstanceSpec, ...]
    #: Bytes of K/V per prompt token sent from prefill to decode (all layers).
    kv_bytes_per_token: float = 0.0
    #: Each prefill instance's outgoing link (None: transfers take no time).
    link: Link | None = None
    #: Send layer by layer during the prefill (hiding up to one step of transfer), over ``num_layers``.
    layerwise: bool = False
    num_layers: int = 1
    #: Fixed cost per transfer on top of the link's (control messages, registration).
    transfer_overhead_s: float = 0.0
    label: str = ""
    #: Where requests go and when a prompt is held back; None: the real cluster's :class:`Router`.
    router: Router | None = None
    #: Control-plane latency (a message between processes; 0 for an engine in the client's process): from a
    #: request's arrival to its first instance having it, and to a decode instance having it after its first
    #: token (the front end routes it there on hearing of that token).
    dispatch_latency_s: float = 0.0
    #: From an instance's output to the client having it (every token; a decode hop hears of the first token
    #: this late too).
    output_latency_s: float = 0.0
    #: Push (minipd's ``kv_transfer="push"`` and ``"layerwise"``, Mooncake): blocks are reserved on a decode
    #: instance before the prefill starts (the request reaches it after ``dispatch_latency_s``, the prompt reaches
    #: a prefill instance a reply and a dispatch later), and the prefill instance sends the K/V as soon as the
    #: prompt is computed, while the first token travels to the client and the request to its decode instance.
    #: Pull (False; vLLM's NIXL connector, DistServe): the decode instance is chosen after the first token and
    #: reads the K/V once it has admitted the request. (A reservation here waits in the decode instance's queue
    #: like any request, where minipd's workers take it between steps whatever their batch holds.)
    push: bool = False

    def __post_init__(self) -> None:
        roles = {spec.role for spec in self.instances}
        if not roles or roles - {"colocated", "prefill", "decode"}:
            raise ValueError(f"instances need roles among colocated, prefill, decode; got {sorted(roles)}")
        if "colocated" in roles and roles != {"colocated"}:
            raise ValueError("a cluster is either colocated or disaggregated (prefill and decode instances)")
        if roles != {"colocated"} and roles != {"prefill", "decode"}:
            raise ValueError("a disaggregated cluster needs prefill and decode instances")
        for name in ("dispatch_latency_s", "output_latency_s", "transfer_overhead_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    @property
    def disaggregated(self) -> bool:
        return self.instances[0].role != "colocated"

    @property
    def hand_over_s(self) -> float:
        """A worker's message heard by the front end and its answer sent on: an output, then a dispatch."""
        return self.output_latency_s + self.dispatch_latency_s

    @property
    def devices(self) -> int:
        """Devices the cluster uses."""
        return sum(spec.count * spec.devices for spec in self.instances)

    def describe(self) -> str:
        """``"2P(tp2)+4D"`` or ``"4C(tp2)"``: what the placement is, in a few characters."""
        letter = {"colocated": "C", "prefill": "P", "decode": "D"}
        return "+".join(f"{s.count}{letter[s.role]}" + (f"(tp{s.devices})" if s.devices > 1 else "")
                        for s in self.instances)

    @classmethod
    def colocated(cls, model: StepTimeModel, config: InstanceConfig, count: int = 1, devices: int = 1,
                  label: str = "") -> ClusterSpec:
        """``count`` colocated instances."""
        return cls((InstanceSpec("colocated", model, config, count, devices),), label=label)

    @classmethod
    def disaggregated_cluster(cls, prefill: InstanceSpec, decode: InstanceSpec, kv_bytes_per_token: float,
                              link: Link | None, layerwise: bool = False, num_layers: int = 1,
                              transfer_overhead_s: float = 0.0, label: str = "", push: bool = False) -> ClusterSpec:
        """Prefill instances and decode instances joined by ``link``."""
        return cls((prefill, decode), kv_bytes_per_token, link, layerwise, num_layers, transfer_overhead_s, label,
                   push=push)

    def with_router(self, router: Router) -> ClusterSpec:
        """The same cluster routed by ``router`` (e.g. a subclass with another decode choice)."""
        return dataclasses.replace(self, router=router)

    def with_control_latency(self, dispatch_s: float, output_s: float) -> ClusterSpec:
        """The same cluster with its processes' messages taking time (see :attr:`dispatch_latency_s` and
        :attr:`output_latency_s`; :func:`minipd.sim.validate.fit_control_latency` measures them)."""
        return dataclasses.replace(self, dispatch_latency_s=dispatch_s, output_latency_s=output_s)


@dataclass
class SimRequest:
    """What one simulated request went through (seconds of simulated time)."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    #: Why it never ran ("" if it did): it could never fit an instance's KV pool.
    dropped: str = ""
    prefill_instance: str = ""
    decode_instance: str = ""
    transfer_start: float | None = None
    transfer_end: float | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return (self.finished or self.token_times[-1]) - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 with one token)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def queueing(self) -> float:
        """From arrival to its first scheduled step."""
        return (self.first_scheduled if self.first_scheduled is not None else self.arrival) - self.arrival

    @property
    def transfer_time(self) -> float:
        """From the start of its K/V transfer to the K/V being in the decode instance's blocks."""
        if self.transfer_start is None or self.transfer_end is None:
            return 0.0
        return self.transfer_end - self.transfer_start

    def to_result(self) -> RequestResult:
        """As the load generator reports a request (the same summaries and SLO checks apply)."""
        if self.dropped or self.finished is None:
            return RequestResult(self.arrival, self.arrival, False, self.dropped or "unfinished", self.prompt_len)
        times = self.token_times
        return RequestResult(self.arrival, self.arrival, True, "", self.prompt_len, len(times), self.ttft, self.e2e,
                             [b - a for a, b in itertools.pairwise(times)])


@dataclass
class SimResult:
    """One simulated run: every request, every instance, the run's length."""

    spec: ClusterSpec
    requests: list[SimRequest]
    instances: dict[str, InstanceStats]
    duration: float
    #: Whether the run stopped once it was certain to miss its target (``simulate(..., until_verdict=...)``):
    #: the requests it had not finished then count as missed, so :meth:`attainment` is a lower bound, below the
    #: target as the whole run's is.
    stopped_early: bool = False

    def results(self) -> list[RequestResult]:
        return [r.to_result() for r in self.requests]

    def summary(self, slo: Slo | None = None) -> dict[str, Any]:
        """The load generator's summary (vLLM's benchmark keys, ms) of the simulated requests."""
        return summarize(self.results(), slo)

    def attainment(self, slo: Slo) -> float:
        """Share of requests (dropped ones count as missed) that met every objective of ``slo``."""
        return attainment_share(self.results(), slo)

    def utilisation(self, while_arriving: bool = False) -> dict[str, float]:
        """Each instance's busy share: of the whole run, or with ``while_arriving`` of the window from the first
        arrival to the last (the steady state). The whole run ends with a drain that has only decodes left,
        which flatters colocated instances and idles prefill ones. ``while_arriving`` needs a run simulated with
        ``keep_timeline=True``."""
        start = min((r.arrival for r in self.requests), default=0.0)
        end = max((r.arrival for r in self.requests), default=0.0)
        if not while_arriving or end <= start:
            return {name: stats.busy_time / self.duration if self.duration else 0.0
                    for name, stats in self.instances.items()}
        shares = {}
        for name, stats in self.instances.items():
            if stats.steps and not stats.timeline:
                raise ValueError("utilisation(while_arriving=True) needs the steps' timeline: "
                                 "simulate(..., keep_timeline=True)")
            busy = sum(max(0.0, min(s + d, end) - max(s, start)) for s, d, _, _ in stats.timeline)
            shares[name] = busy / (end - start)
        return shares

    @property
    def num_dropped(self) -> int:
        return sum(bool(r.dropped) for r in self.requests)


#: How long after a deadline a request is checked (seconds): a token exactly on time meets its objective.
_JUST_AFTER = 1e-9


class _Verdict:
    """Whether at least ``attainment`` of ``total`` requests meet ``slo``, counted as they are judged: a request
    is judged when it finishes (or is dropped), or as soon as it is sure to miss an objective: when the run's
    clock passes a deadline (first token, last token, end) the request has not met by then
    (see :meth:`_Cluster._judge_missed_at`)."""

    def __init__(self, slo: Slo, attainment: float, total: int) -> None:
        if not 0 < attainment <= 1:
            raise ValueError(f"until_verdict: the attainment must be in (0, 1], got {attainment}")
        self.slo, self.total = slo, total
        self.needed = math.ceil(attainment * total - 1e-9)  # (0.9 of 200 is 180, not 181 by rounding error)
        self.met = self.missed = 0
        self.judged: set[int] = set()

    def judge(self, sim: SimRequest, met: bool) -> None:
        if sim.index not in self.judged:
            self.judged.add(sim.index)
            if met:
                self.met += 1
            else:
                self.missed += 1

    @property
    def failed(self) -> bool:
        """Too many missed for the target to be met whatever the rest do. (A run sure to pass is not stopped:
        its last requests drain in light steps that cost little, and its attainment is then exact.)"""
        return self.missed > self.total - self.needed


class _Cluster:
    """One run's state: the environment, the instances and the requests."""

    def __init__(self, spec: ClusterSpec, workload: Sequence[PlannedRequest], keep_timeline: bool,
                 progress: Callable[[int], None] | None, verdict: tuple[Slo, float] | None = None) -> None:
        import simpy

        self.env = simpy.Environment()
        self.spec = spec
        self.progress = progress
        self.requests = [SimRequest(i, p.send_at, p.prompt_len, p.output_len) for i, p in enumerate(workload)]
        self.live: dict[str, SimRequest] = {}
        self.pending = len(self.requests)
        self.all_done = self.env.event()
        self.verdict = None if verdict is None else _Verdict(*verdict, len(self.requests))
        self.instances: dict[str, list[SimInstance]] = {"colocated": [], "prefill": [], "decode": []}
        self.links: dict[str, Any] = {}
        self.held: dict[str, SimInstance] = {}  # request id -> the prefill instance keeping its K/V
        self.router = spec.router or Router()
        #: Prompts held back by backpressure, oldest first; and the blocks each prefill under way will need
        #: on its decode instance (by request id).
        self.backlog: list[SimRequest] = []
        self.prefilling: dict[str, int] = {}
        #: Push: requests whose decode blocks are being reserved, before their prefill.
        self.reserving: dict[str, SimRequest] = {}
        self._params: dict[int, SamplingParams] = {}
        shared = None
        if any(s.sharing_slowdown > 0 for s in spec.instances):
            from minipd.sim.sharing import SharedCores

            shared = SharedCores(self.env)
        for s in spec.instances:
            if hasattr(s.model, "bind"):  # a model that needs the simulation's clock (a replay)
                s.model.bind(lambda: self.env.now)
            for index in range(s.count):
                name = f"{s.role}{index}"
                instance = SimInstance(self.env, name, s.role, s.model, s.config, self._on_outputs,
                                       self._on_waiting_for_kv if s.role == "decode" else None, keep_timeline,
                                       shared=shared, sharing_slowdown=s.sharing_slowdown)
                self.instances[s.role].append(instance)
                if s.role == "prefill":
                    self.links[name] = simpy.Resource(self.env, capacity=1)
        self.env.process(self._arrivals())

    # ---------------------------------------------------------------------------- requests
    def _sampling(self, max_tokens: int) -> SamplingParams:
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return params

    def _request(self, sim: SimRequest, instance: SimInstance, phase: str) -> Request:
        """``sim`` as ``instance`` takes it: whole (colocated), its prefill alone (first token, K/V kept for the
        transfer), or its decode (prompt and first token, the prompt's K/V to come from the prefill instance)."""
        decode = phase == "decode"
        return Request(request_id=str(sim.index), all_token_ids=[1] * sim.prompt_len + ([SIM_TOKEN] if decode else []),
                       num_prompt_tokens=sim.prompt_len,
                       params=self._sampling(1 if phase == "prefill" else sim.output_len), seed=0,
                       eos_token_ids=frozenset(), max_model_len=instance.config.max_model_len,
                       arrival_time=sim.arrival, hold_kv=phase == "prefill" and sim.output_len > 1,
                       num_external_tokens=sim.prompt_len if decode else 0)

    def _arrivals(self) -> Any:
        env = self.env
        delay = self.spec.dispatch_latency_s  # (the same for every request: the order holds)
        for sim in self.requests:
            if sim.arrival + delay > env.now:
                yield env.timeout(sim.arrival + delay - env.now)
            self.live[str(sim.index)] = sim
            if self.verdict is not None:
                slo = self.verdict.slo
                if slo.ttft_ms is not None:
                    self._judge_missed_at(sim, sim.arrival + slo.ttft_ms / 1e3, lambda s: bool(s.token_times))
                if slo.e2el_ms is not None:
                    self._judge_missed_at(sim, sim.arrival + slo.e2el_ms / 1e3, lambda s: s.finished is not None)
            if self.spec.disaggregated:
                if self.backlog or not self._decode_has_room(sim):
                    self.backlog.append(sim)
                else:
                    self._to_prefill(sim)
            else:
                instance = self.router.prefill_worker(self.instances["colocated"])
                sim.prefill_instance = sim.decode_instance = instance.name
                self._admit(sim, instance, self._request(sim, instance, "whole"))

    def _blocks_for(self, sim: SimRequest) -> int:
        """Blocks ``sim`` needs on a decode instance (as the real router counts them)."""
        return blocks_for(sim.prompt_len, self.instances["decode"][0].config.block_size)

    def _decode_has_room(self, sim: SimRequest) -> bool:
        """The router's backpressure: whether a decode instance will have room for ``sim`` once the prefills
        under way have landed. A request no decode pool could ever hold is let through (and dropped there,
        with the reason), not held for ever."""
        needed = self._blocks_for(sim)
        if needed > max(d.config.num_kv_blocks for d in self.instances["decode"]):
            return True
        return self.router.decode_has_room(self.instances["decode"], list(self.prefilling.values()), needed)

    def _to_prefill(self, sim: SimRequest) -> None:
        if self.spec.push:
            # Reserve first: the decode request waits for its K/V in blocks of its own (its scheduler allocates
            # them at its next step), and its prompt goes to a prefill instance once they are held. (As the engine
            # does, even for a request that will end at its first token.)
            decode = self.router.decode_worker(self.instances["decode"])
            sim.decode_instance = decode.name
            self.reserving[str(sim.index)] = sim
            if not self._admit(sim, decode, self._request(sim, decode, "decode")):
                del self.reserving[str(sim.index)]
            return
        self._prefill(sim)

    def _prefill(self, sim: SimRequest) -> None:
        instance = self.router.prefill_worker(self.instances["prefill"])
        sim.prefill_instance = instance.name
        if not self._admit(sim, instance, self._request(sim, instance, "prefill")):
            if self.spec.push:  # refused after its decode blocks were reserved: they go back
                self._release_reservation(sim)
            return
        if sim.output_len > 1 and not self.spec.push:  # (pushed requests hold their decode blocks already)
            self.prefilling[str(sim.index)] = self._blocks_for(sim)

    def _release_reservation(self, sim: SimRequest) -> None:
        self._decode_instance(sim).release_kv(str(sim.index))
        self._admit_backlog()

    def _decode_instance(self, sim: SimRequest) -> SimInstance:
        return next(d for d in self.instances["decode"] if d.name == sim.decode_instance)

    def _admit_backlog(self) -> None:
        while self.backlog and self._decode_has_room(self.backlog[0]):
            self._to_prefill(self.backlog.pop(0))

    def _admit(self, sim: SimRequest, instance: SimInstance, request: Request) -> bool:
        """Queue ``request`` on ``instance``; False (and the request counted dropped, with why) if it cannot fit."""
        if sim.prompt_len >= instance.config.max_model_len:  # (the engine's front end refuses it too)
            sim.dropped = (f"{instance.name}: a prompt of {sim.prompt_len} tokens leaves no room in the model's "
                           f"context of {instance.config.max_model_len}")
        else:
            try:
                instance.add(request)
                return True
            except ParameterError as err:
                sim.dropped = f"{instance.name}: {err}"
        self._done(sim)
        return False

    def _done(self, sim: SimRequest) -> None:
        self.live.pop(str(sim.index), None)
        self.pending -= 1
        if self.progress is not None:
            self.progress(1)
        if self.verdict is not None:
            self.verdict.judge(sim, self.verdict.slo.met(sim.to_result()))
        self._end_if_over()

    def _end_if_over(self) -> None:
        """End the run once every request is done, or once it is sure to miss its target (when one is given)."""
        over = self.pending == 0 or (self.verdict is not None and self.verdict.failed)
        if over and not self.all_done.triggered:
            self.all_done.succeed()

    # ---------------------------------------------------------------------------- outputs
    def _on_outputs(self, instance: SimInstance, outputs: EngineCoreOutputs) -> None:
        now = self.env.now + self.spec.output_latency_s  # when the client has them
        live, verdict, role = self.live, self.verdict, instance.role
        for out in outputs.outputs:  # (once per token of the run: kept lean)
            sim = live[out.request_id]
            if not sim.token_times:
                if sim.first_scheduled is None:
                    sim.first_scheduled = out.first_scheduled_time
                if verdict is not None and verdict.slo.tpot_ms is not None and sim.output_len > 1:
                    # Its last token is due ``output_len - 1`` TPOT targets after this one (fewer tokens, if the
                    # context cuts it short, would be due sooner: the deadline is never early).
                    self._judge_missed_at(sim, now + verdict.slo.tpot_ms / 1e3 * (sim.output_len - 1),
                                          lambda s: s.finished is not None)
            sim.token_times.extend([now] * len(out.new_token_ids))
            if role == "prefill":
                if sim.output_len == 1:
                    sim.finished = now
                    self._done(sim)
                    if self.spec.push:  # (once the front end has heard of it and told the decode instance)
                        self._after(self.spec.hand_over_s, self._release_reservation, sim)
                elif self.spec.push:
                    self.env.process(self._push(sim, instance))
                else:
                    self.held[out.request_id] = instance
                    self._after(self.spec.hand_over_s, self._to_decode, sim, instance)
            elif out.finished:
                sim.finished = now
                self._done(sim)
        if self.backlog and instance.role == "decode":
            self._admit_backlog()  # a decode step may have freed blocks

    def _judge_missed_at(self, sim: SimRequest, deadline: float, done: Callable[[SimRequest], bool]) -> None:
        """Judge ``sim`` missed unless ``done(sim)`` holds when the client's clock passes ``deadline`` (seconds):
        a request stuck in a queue is known to miss long before it is served, and an overloaded run's verdict
        comes sooner. (The client hears of an output ``output_latency_s`` after its step: the check runs that
        much earlier on the simulation's clock, and just after the deadline, since one met exactly counts.)"""
        verdict = self.verdict
        assert verdict is not None

        def check(_: Any) -> None:
            if sim.index not in verdict.judged and not done(sim):
                verdict.judge(sim, False)
                self._end_if_over()

        delay = deadline - self.spec.output_latency_s - self.env.now
        # (just after: by more than the clock's rounding, however long the run)
        self.env.timeout(max(0.0, delay) + max(_JUST_AFTER, 4 * math.ulp(deadline))).callbacks.append(check)

    def _after(self, seconds: float, action: Callable[..., None], *args: Any) -> None:
        """``action(*args)`` ``seconds`` from now (at once for 0: a control message that takes no time)."""
        if seconds <= 0:
            action(*args)
            return

        def later() -> Any:
            yield self.env.timeout(seconds)
            action(*args)

        self.env.process(later())

    def _to_decode(self, sim: SimRequest, source: SimInstance) -> None:
        self.prefilling.pop(str(sim.index), None)
        decode = self.router.decode_worker(self.instances["decode"])
        sim.decode_instance = decode.name
        if not self._admit(sim, decode, self._request(sim, decode, "decode")):
            source.release_kv(str(sim.index))
            if self.backlog:
                # Dropped at the decode instance, it is no longer on its way there: room for a held prompt,
                # with perhaps no decode step ever coming to look again.
                self._admit_backlog()

    def _on_waiting_for_kv(self, decode: SimInstance, request: Request) -> None:
        if self.spec.push:
            sim = self.reserving.pop(request.request_id, None)
            if sim is not None:  # its blocks are held: the front end hears so, then sends the prompt on
                self._after(self.spec.hand_over_s, self._prefill, sim)
            return
        self.env.process(self._transfer(decode, request.request_id))

    def _send(self, sim: SimRequest, source: SimInstance) -> Any:
        """Move ``sim``'s K/V over ``source``'s link (one transfer at a time), then free them at the source."""
        env, spec = self.env, self.spec
        link = spec.link
        if link is None:
            sim.transfer_start = sim.transfer_end = env.now
        else:
            with self.links[source.name].request() as turn:
                yield turn
                sim.transfer_start = env.now
                seconds = spec.transfer_overhead_s + link.latency_s + \
                    spec.kv_bytes_per_token * sim.prompt_len / link.bandwidth
                visible = seconds
                if spec.layerwise:
                    # Sent while the prefill's last step computed the later layers: hidden up to that step.
                    waited = env.now - (sim.token_times[0] - spec.output_latency_s)  # since the prefill ended
                    hidden = max(0.0, source.last_step_duration - waited)
                    visible = max(seconds / spec.num_layers, seconds - hidden)
                yield env.timeout(visible)
                sim.transfer_end = env.now
        source.release_kv(str(sim.index))

    def _transfer(self, decode: SimInstance, request_id: str) -> Any:
        yield from self._send(self.live[request_id], self.held.pop(request_id))
        decode.kv_arrived(request_id)

    def _push(self, sim: SimRequest, source: SimInstance) -> Any:
        """Push: the K/V leave at once; the decode instance computes once they are in and it has the request
        (the front end hands it over on hearing of the first token: both control hops)."""
        handed_over = self.env.now + self.spec.hand_over_s
        yield from self._send(sim, source)
        if handed_over > self.env.now:
            yield self.env.timeout(handed_over - self.env.now)
        self._decode_instance(sim).kv_arrived(str(sim.index))


def simulate(spec: ClusterSpec, workload: Sequence[PlannedRequest], *, keep_timeline: bool = False,
             progress: bool = False, until_verdict: tuple[Slo, float] | None = None) -> SimResult:
    """Run ``workload`` (requests with arrival times and lengths, :mod:`minipd.serve.workload`) through the
    cluster ``spec`` until every request has finished or been dropped.

    ``until_verdict=(slo, attainment)`` stops the run as soon as it is certain that fewer than ``attainment``
    of the requests will meet ``slo`` (what a goodput search asks of each run): the requests not finished then
    count as missed, so the run's attainment is below the target, as the whole run's would be
    (:attr:`SimResult.stopped_early` says it stopped). An overloaded run is decided after its first few
    late requests, not after draining its whole queue; a run that meets the target runs to its end."""
    if not workload:
        raise ValueError("the workload holds no requests")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(workload), desc=f"simulating {spec.describe()}", unit="req", leave=False)
    cluster = _Cluster(spec, workload, keep_timeline, None if bar is None else bar.update, until_verdict)
    try:
        cluster.env.run(until=cluster.all_done)
    finally:
        if bar is not None:
            bar.close()
    stats = {}
    for group in cluster.instances.values():
        for instance in group:
            instance.finish_stats()
            stats[instance.name] = instance.stats
    return SimResult(spec, cluster.requests, stats, cluster.env.now, stopped_early=cluster.pending > 0)


__all__ = ["ClusterSpec", "InstanceSpec", "SimRequest", "SimResult", "simulate"]
