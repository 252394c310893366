"""Chapter 05 exercises: the KV bytes a disaggregated request moves, when its K/V are ready on the decode
side (after the prefill, or layer by layer), and the two decisions of the cluster's router, plugged into
a running :class:`minipd.DisaggregatedLLM`: which decode worker takes a prefilled request, and whether
a new prompt may be prefilled now or must wait in the front end (backpressure).

Each exercise has a reference solution (``reference_<name>``, written plainly so a stuck reader can
read it) and a checker (``check_<name>(fn)``) that prints PASS, FAIL (the largest difference and the
first case, decision or token that differs) or TODO. The two formula checkers run the reader's function
on fixed cases, edge cases included; ``reference_kv_transfer_bytes`` counts what
:class:`minipd.DisaggregatedLLM` moves (whole blocks of the prompt; ``tests/test_exercises_ch05.py``
compares it with a real run). The two router checkers put the reader's function into a
:class:`ReaderRouter`, start a cluster of one prefill and two decode workers with it
(``DisaggregatedLLM(router=...)``), and judge what the cluster then did: every decision it took with
the reader's rule against the reference's on the same loads, where each request was decoded, whether
it stalled, and its outputs against one colocated engine's. Each of those takes one cluster start
(seconds per worker process) and shuts the workers down however it ends.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minipd.exercises.ch04 import _check_numbers
from minipd.exercises.checking import Case, CheckResult, describe_exception, report, todo
from minipd.pd.routing import Router, WorkerLoad

__all__ = [
    "CLUSTER",
    "LINKS",
    "MODEL_SHAPES",
    "ClusterRun",
    "Decision",
    "ReaderRouter",
    "WorkerView",
    "check_decode_has_room",
    "check_decode_worker",
    "check_kv_ready_time",
    "check_kv_transfer_bytes",
    "colocated_tokens",
    "engine_prompts",
    "reference_decode_has_room",
    "reference_decode_worker",
    "reference_kv_ready_time",
    "reference_kv_transfer_bytes",
    "run_cluster",
]

#: The KV-relevant shape of real models, from their public config.json files on the Hugging Face hub.
#: DeepSeek-V3 uses multi-head latent attention (MLA): one compressed latent of ``kv_lora_rank``
#: values plus a shared ``qk_rope_head_dim`` rotary key per token and layer, instead of K and V per head.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "Llama-2-7B": dict(num_hidden_layers=32, num_key_value_heads=32, head_dim=128),  # MHA: 32 KV heads
    "Llama-3-8B": dict(num_hidden_layers=32, num_key_value_heads=8, head_dim=128),
    "Llama-3-70B": dict(num_hidden_layers=80, num_key_value_heads=8, head_dim=128),
    "Qwen3-32B": dict(num_hidden_layers=64, num_key_value_heads=8, head_dim=128),
    "DeepSeek-V3": dict(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64),
}

#: Link bandwidths in bytes/s (one direction): PCIe Gen5 x16 ~64 GB/s, NVLink 4 (H100) 900 GB/s
#: in all, one 400 Gb/s InfiniBand or RoCE NIC ~50 GB/s.
LINKS: dict[str, float] = {"400G IB/RoCE": 50e9, "PCIe Gen5 x16": 64e9, "NVLink 4": 900e9}


# --- reference solutions ------------------------------------------------------------------------


def reference_kv_transfer_bytes(shape: dict[str, int], prompt_len: int, block_size: int = 16,
                                dtype_bytes: int = 2) -> int:
    """Bytes a decode worker reads to continue a request whose ``prompt_len`` prompt tokens were prefilled.

    The cache is paged, and whole blocks move: ``ceil(prompt_len / block_size)`` blocks of
    ``block_size`` tokens (``block_size=1`` counts exact tokens). One token keeps, in every layer,
    K and V for each KV head (``2 · num_key_value_heads · head_dim`` values), or, for MLA (a shape
    with ``kv_lora_rank``), one latent and one rotary key (``kv_lora_rank + qk_rope_head_dim`` values).
    """
    if "kv_lora_rank" in shape:
        values_per_layer = shape["kv_lora_rank"] + shape["qk_rope_head_dim"]
    else:
        values_per_layer = 2 * shape["num_key_value_heads"] * shape["head_dim"]
    bytes_per_token = shape["num_hidden_layers"] * values_per_layer * dtype_bytes
    num_blocks = -(-prompt_len // block_size)
    return num_blocks * block_size * bytes_per_token


def reference_kv_ready_time(prefill_s: float, transfer_s: float, num_layers: int, mode: str) -> float:
    """Seconds from the start of the prefill until the decode worker holds all of the prompt's K/V.

    ``"pull"``: the transfer starts when the whole prefill is done: ``prefill_s + transfer_s``.
    ``"layerwise"``: layer ``i``'s K/V are sent as soon as layer ``i`` is computed, one layer's
    transfer at a time on the link. With ``c = prefill_s / num_layers`` and ``t = transfer_s /
    num_layers``, the last layer's K/V arrive at ``c + t + (num_layers - 1) · max(c, t)``: if the link is
    faster than the compute, only one layer's transfer shows; if slower, the link sets the pace.
    """
    if mode == "pull":
        return prefill_s + transfer_s
    if mode == "layerwise":
        c, t = prefill_s / num_layers, transfer_s / num_layers
        return c + t + (num_layers - 1) * max(c, t)
    raise ValueError(f"mode must be 'pull' or 'layerwise', got {mode!r}")


def reference_decode_worker(workers: Sequence[WorkerView]) -> WorkerView:
    """The decode worker a prefilled request goes to: the one with the most free KV blocks.

    Decode is bounded by memory: a decoding request keeps its blocks, and needs more as it grows, until
    it finishes. ``workers`` lists the live decode workers (each with ``name``, ``free_blocks``, counting
    blocks already promised to requests on their way, and ``num_requests``); return one of them. On a tie
    any of the tied ones will do (this one, like :class:`minipd.pd.routing.Router`, keeps the first).
    """
    best = workers[0]
    for worker in workers[1:]:
        if worker.free_blocks > best.free_blocks:
            best = worker
    return best


def reference_decode_has_room(decoders: Sequence[WorkerView], on_their_way: Sequence[int], needed: int) -> bool:
    """Whether a new prompt may be prefilled now: some decode worker will have ``needed`` free blocks for it.

    ``on_their_way`` lists the blocks of the prompts already prefilling whose decode worker is not chosen
    yet. Each of those will go where the room is largest when it gets there, so count them in, one by
    one, each taking its blocks from the worker with the most room at that moment; then some worker must
    still have ``needed`` blocks. With no decode worker at all the prefill workers decode themselves: True.
    (:meth:`minipd.pd.routing.Router.decode_has_room` is the engine's own.)
    """
    if not decoders:
        return True
    room = [worker.free_blocks for worker in decoders]
    for blocks in on_their_way:
        most = room.index(max(room))
        room[most] -= blocks
    return max(room) >= needed


# --- cases --------------------------------------------------------------------------------------

#: tiny-py, the bundled model: 6 layers, 2 KV heads of 32 dims, an fp32 cache.
TINY_PY = dict(num_hidden_layers=6, num_key_value_heads=2, head_dim=32)


def _bytes_cases() -> list[Case]:
    cases = [
        Case("tiny-py, 8 tokens (one block, fp32)", (TINY_PY, 8, 16, 4)),
        Case("tiny-py, 512 tokens (32 full blocks, fp32)", (TINY_PY, 512, 16, 4)),
        Case("tiny-py, 17 tokens: a second, nearly empty block", (TINY_PY, 17, 16, 4)),
        Case("Llama-3-8B, 1 token, exact (block_size 1)", (MODEL_SHAPES["Llama-3-8B"], 1, 1, 2)),
    ]
    for name, shape in MODEL_SHAPES.items():
        cases.append(Case(f"{name}, 4000 tokens, blocks of 16, bf16", (shape, 4000, 16, 2)))
    cases += [
        Case("Llama-3-70B, 1000 tokens, int8 cache, blocks of 256", (MODEL_SHAPES["Llama-3-70B"], 1000, 256, 1)),
        Case("DeepSeek-V3, 1 token, exact", (MODEL_SHAPES["DeepSeek-V3"], 1, 1, 2)),
        Case("DeepSeek-V3, 300 tokens, blocks of 64", (MODEL_SHAPES["DeepSeek-V3"], 300, 64, 2)),
    ]
    return cases


def _ready_cases() -> list[Case]:
    return [
        Case("pull: prefill then transfer", (0.2, 0.05, 32, "pull")),
        Case("layerwise, fast link: one layer's transfer shows", (0.32, 0.032, 32, "layerwise")),
        Case("layerwise, slow link: the link sets the pace", (0.1, 0.4, 40, "layerwise")),
        Case("layerwise, link as fast as compute", (0.3, 0.3, 30, "layerwise")),
        Case("layerwise, one layer: nothing to overlap", (0.2, 0.05, 1, "layerwise")),
        Case("pull, no transfer at all", (0.2, 0.0, 32, "pull")),
        Case("layerwise, 80 layers", (1.6, 0.2, 80, "layerwise")),
    ]


# --- checking -----------------------------------------------------------------------------------


def check_kv_transfer_bytes(fn: Callable[..., int]) -> CheckResult:
    """Check ``fn(shape, prompt_len, block_size, dtype_bytes) -> bytes`` against :func:`reference_kv_transfer_bytes`."""
    return report(_check_numbers("kv_transfer_bytes", fn, reference_kv_transfer_bytes, _bytes_cases(), 0, int))


def check_kv_ready_time(fn: Callable[..., float]) -> CheckResult:
    """Check ``fn(prefill_s, transfer_s, num_layers, mode) -> seconds`` against :func:`reference_kv_ready_time`."""
    return report(_check_numbers("kv_ready_time", fn, reference_kv_ready_time, _ready_cases(), 1e-9,
                                 (int, float)))


# --- the router's decisions, plugged into a running cluster -------------------------------------


@dataclass(frozen=True)
class WorkerView:
    """A decode worker as the router sees it when it decides: a copy, so changing it changes nothing.

    ``free_blocks`` counts the blocks of its KV pool that are free, less those already promised to
    requests on their way to it; ``num_requests`` the requests it holds now.
    """

    name: str
    free_blocks: int
    num_requests: int


@dataclass(frozen=True)
class Decision:
    """One question the cluster asked its router, what the reader's function answered, and the rule's answer.

    ``answer`` and ``expected`` are worker names for ``decode_worker`` and booleans for ``decode_has_room``
    (whose question also carries ``on_their_way`` and ``needed``).
    """

    workers: tuple[WorkerView, ...]
    answer: Any
    expected: Any
    on_their_way: tuple[int, ...] = ()
    needed: int = 0

    @property
    def right(self) -> bool:
        """Whether the answer is the rule's (for ``decode_worker``: a worker with as many free blocks)."""
        if isinstance(self.expected, bool):
            return self.answer is self.expected
        return self.free_of(self.answer) == self.free_of(self.expected)

    def free_of(self, name: str) -> int:
        """The free blocks the worker called ``name`` had when this decision was made."""
        return next(w.free_blocks for w in self.workers if w.name == name)


class ReaderRouter(Router):
    """The cluster's router with the reader's ``decode_worker`` and/or ``decode_has_room`` in place of its own.

    ``DisaggregatedLLM(..., router=ReaderRouter(decode_worker=my_fn))`` routes every decode with
    ``my_fn``, called with :class:`WorkerView` copies of the live decode workers. Every question is kept in
    :attr:`decisions` with the reference's answer to the same question. An answer the engine cannot use (an
    exception, something that is not one of the workers or not a bool) is kept in :attr:`failure`, and the
    reference's answer is used instead, so that the cluster stays sound until the checker stops it.
    """

    def __init__(self, decode_worker: Callable[..., Any] | None = None,
                 decode_has_room: Callable[..., Any] | None = None) -> None:
        self.reader_decode_worker = decode_worker
        self.reader_decode_has_room = decode_has_room
        self.decisions: list[Decision] = []
        #: The first answer the engine could not use: ``("todo", "")`` or ``("fail", what happened)``.
        self.failure: tuple[str, str] | None = None

    def _call(self, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        try:
            return True, fn(*args)
        except NotImplementedError:
            self.failure = self.failure or ("todo", "")
        except Exception as err:  # the reader's bug: reported by the checker, never raised into the cluster
            self.failure = self.failure or ("fail", f"raised {describe_exception(err)}")
        return False, None

    def decode_worker(self, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        views = tuple(WorkerView(w.name, w.free_blocks, w.num_requests) for w in workers)
        expected = reference_decode_worker(views)
        if self.reader_decode_worker is None or self.failure is not None:
            return workers[views.index(expected)]
        ok, answer = self._call(self.reader_decode_worker, list(views))
        if not ok:
            return workers[views.index(expected)]
        where = next((i for i, view in enumerate(views) if view is answer), None)
        if where is None:
            self.failure = ("fail", f"returned {answer!r}; expected one of the WorkerView objects it was given "
                                    f"{list(views)}")
            return workers[views.index(expected)]
        self.decisions.append(Decision(views, views[where].name, expected.name))
        return workers[where]

    def decode_has_room(self, decoders: Sequence[WorkerLoad], on_their_way: Sequence[int], needed: int) -> bool:
        views = tuple(WorkerView(w.name, w.free_blocks, w.num_requests) for w in decoders)
        expected = reference_decode_has_room(views, list(on_their_way), needed)
        if self.reader_decode_has_room is None or self.failure is not None:
            return expected
        ok, answer = self._call(self.reader_decode_has_room, list(views), list(on_their_way), needed)
        if not ok:
            return expected
        if not isinstance(answer, bool):
            self.failure = ("fail", f"returned {type(answer).__name__} {answer!r}; expected True or False")
            return expected
        decision = Decision(views, answer, expected, tuple(on_their_way), needed)
        # The backlog's head is asked again at every poll while it waits: one record per distinct question.
        if not self.decisions or self.decisions[-1] != decision:
            self.decisions.append(decision)
        return answer


#: The cluster every engine check runs: one prefill and two decode workers of the bundled model, each a
#: process with one thread, K/V pulled over torch.distributed (every platform), prefix caching off.
CLUSTER = dict(num_prefill_workers=1, num_decode_workers=2, kv_transfer="pull", kv_transport="torch",
               enable_prefix_caching=False)
MODEL = "tiny-py"
#: Seconds the workers may take to start, the run may take, and the cluster may sit with prompts held
#: back and nothing else happening before the checker calls it stuck.
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 60.0
STALL_S = 3.0

#: ``decode_worker``: prompt lengths far apart (1 to 8 blocks), so that counting requests and counting
#: blocks send requests to different workers; pools large enough that nothing waits for room.
ROUTE_PROMPT_LENS = [120, 10, 20, 8, 100, 14, 40, 8, 70, 24, 9, 33]
ROUTE_KV_BLOCKS = 64
#: ``decode_has_room``: a burst of 16 prompts of 33 tokens (3 blocks each, 41 tokens at the end, so
#: nothing grows out of its blocks) at decode pools of 16 blocks each: 48 blocks asked of 32.
ROOM_PROMPT_LENS = [33] * 16
ROOM_KV_BLOCKS = 16
ENGINE_MAX_TOKENS = 8


def engine_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Fixed prompts of the given lengths (token ids of tiny-py's vocabulary, drawn with ``seed``)."""
    draw = random.Random(seed)
    return [[draw.randrange(1, 4000) for _ in range(n)] for n in lengths]


@dataclass
class ClusterRun:
    """What a cluster did with a router: its outputs (None unless every request finished), the prompts it
    held back in the front end, its workers' step records, and why it stopped early, if it did."""

    outputs: list[Any] | None = None
    held_back: int = 0
    step_stats: list[Any] = field(default_factory=list)
    stopped: str = ""

    def most_waiting(self, role: str) -> int:
        """The most requests that waited in the queue of one worker of ``role`` after any of its steps."""
        return max((s.num_waiting for s in self.step_stats if s.worker.startswith(role)), default=0)


def run_cluster(router: Router, prompts: list[list[int]], num_kv_blocks: int,
                max_tokens: int = ENGINE_MAX_TOKENS) -> ClusterRun:
    """Serve ``prompts`` (greedy, ``max_tokens`` each) on :data:`CLUSTER` routed by ``router``.

    Bounded in time: it stops once the router has an unusable answer, when prompts are held back while
    nothing else happens for :data:`STALL_S` (nothing will ever free room), or after
    :data:`RUN_TIMEOUT_S`. The workers are shut down however it ends.
    """
    from minipd import DisaggregatedLLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    run = ClusterRun()
    with DisaggregatedLLM(MODEL, num_kv_blocks=num_kv_blocks, router=router, start_timeout=START_TIMEOUT_S,
                          **CLUSTER) as pd:
        states = [pd.processor.states[pd.add_request(p, params)] for p in prompts]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        quiet_since = time.monotonic()
        while not all(s.finished for s in states):
            if getattr(router, "failure", None) is not None:
                run.stopped = "failure"
                break
            now = time.monotonic()
            if now > deadline:
                run.stopped = f"the run did not finish in {RUN_TIMEOUT_S:.0f} s"
                break
            if pd.step():
                quiet_since = now
            elif now - quiet_since > STALL_S and pd.num_backpressured and not any(
                    w.requests for w in pd.workers.workers.values()):
                held = sum(not s.finished for s in states)
                run.stopped = (f"the cluster stalled: {held} prompts held back in the front end, no request on "
                               f"any worker, nothing for {STALL_S:.0f} s (nothing will ever free room)")
                break
        if not run.stopped:
            run.outputs = [s.to_output() for s in states]
        run.held_back = pd.num_backpressured
        run.step_stats = list(pd.step_stats)
    return run


def colocated_tokens(prompts: list[list[int]], num_kv_blocks: int, max_tokens: int = ENGINE_MAX_TOKENS
                     ) -> list[list[int]]:
    """Greedy tokens of one colocated engine (``LLM``) for ``prompts``: what the cluster must give."""
    from minipd import LLM, SamplingParams

    llm = LLM(MODEL, enable_prefix_caching=False, num_kv_blocks=max(num_kv_blocks, 128))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _probe(name: str, call: Callable[[], Any], valid: Callable[[Any], str]) -> CheckResult | None:
    """Call the reader's function once outside the engine: TODO for the stub, FAIL for an exception or an
    answer of the wrong kind (``valid`` says what is wrong, or ""), None when the cluster may start."""
    try:
        answer = call()
    except NotImplementedError:
        return todo(name)
    except Exception as err:  # the reader's bug, whatever it is
        return CheckResult("FAIL", name, f"raised {describe_exception(err)} [case: a first call, before the cluster]")
    wrong = valid(answer)
    return CheckResult("FAIL", name, f"{wrong} [case: a first call, before the cluster]") if wrong else None


def _differ(n: int) -> str:
    return "1 decision differs" if n == 1 else f"{n} decisions differ"


def _tokens_mismatch(name: str, outputs: list[Any], expected: list[list[int]], where: str) -> CheckResult | None:
    for index, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        got = list(out.token_ids)
        if got != want:
            first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                         min(len(got), len(want)))
            detail = (f"got {got[first]}, expected {want[first]}" if first < min(len(got), len(want))
                      else f"{len(got)} tokens, expected {len(want)}")
            return CheckResult("FAIL", name, f"{where}: greedy token {first} of request {index} differs from one "
                                             f"engine's: {detail}", max_diff=float("inf"), first_mismatch=first)
    return None


def _run_checked(name: str, router: ReaderRouter, prompts: list[list[int]], num_kv_blocks: int,
                 where: str) -> tuple[ClusterRun | None, CheckResult | None]:
    """Run the cluster with ``router``; the run, or the result that ends the check (TODO, FAIL)."""
    try:
        run = run_cluster(router, prompts, num_kv_blocks)
    except Exception as err:  # the cluster itself failed (it was shut down on the way out)
        return None, CheckResult("FAIL", name, f"{where}: the cluster failed: {describe_exception(err)}")
    if router.failure is not None:
        kind, what = router.failure
        if kind == "todo":
            return None, todo(name)
        return None, CheckResult("FAIL", name, f"{where}: your function {what}")
    return run, None


def _start(name: str, fn: Any, call: Callable[[], Any], valid: Callable[[Any], str], router: ReaderRouter,
           prompts: list[list[int]], num_kv_blocks: int, where: str) -> tuple[ClusterRun | None, CheckResult | None]:
    """Both checkers' start: refuse what is not a function, try it once on made-up loads (:func:`_probe`), then
    run the cluster with ``router``; the run, or the reported result that ends the check."""
    if not callable(fn):
        return None, report(CheckResult("FAIL", name, f"expected a function, got {type(fn).__name__}"))
    failure = _probe(name, call, valid)
    if failure is None:
        run, failure = _run_checked(name, router, prompts, num_kv_blocks, where)
        if failure is None:
            return run, None
    return None, report(failure)


def check_decode_worker(fn: Callable[[list[WorkerView]], WorkerView]) -> CheckResult:
    """Run a cluster whose decodes go where ``fn(workers)`` sends them, and check where they went.

    ``fn`` is first called once on two made-up workers (it must return one of them). Then it routes every
    decode of :data:`CLUSTER` (one prefill, two decode workers) serving twelve prompts of 8 to 120
    tokens, greedy, 8 tokens each. At every routing decision, the worker it chose must have as many free
    blocks as the most free one had then (the first that did not is the first mismatch; the largest
    difference is the most free blocks a choice left unused); each request must have been decoded where
    it chose (``RequestOutput.metrics.decode_worker``); and every output must be one colocated engine's.
    """
    name = "decode_worker"
    probe = [WorkerView("decode0", 3, 1), WorkerView("decode1", 12, 4)]
    where = "in the cluster (1 prefill + 2 decode workers routing decodes with your function)"
    prompts = engine_prompts(ROUTE_PROMPT_LENS, seed=51)
    router = ReaderRouter(decode_worker=fn)
    run, ended = _start(name, fn, lambda: fn(list(probe)), lambda a: "" if any(a is w for w in probe) else
                        f"returned {a!r}; expected one of the WorkerView objects it was given", router, prompts,
                        ROUTE_KV_BLOCKS, where)
    if run is None:
        return ended  # type: ignore[return-value]
    wrong = [(i, d) for i, d in enumerate(router.decisions) if not d.right]
    if wrong:
        index, first = wrong[0]
        unused = max(d.free_of(d.expected) - d.free_of(d.answer) for _, d in wrong)
        loads = ", ".join(f"{w.name}: {w.free_blocks} free blocks, {w.num_requests} requests" for w in first.workers)
        return report(CheckResult(
            "FAIL", name, f"max |diff| {unused} free blocks; first mismatch at routing decision {index} of "
                          f"{len(router.decisions)} ({loads}): your function sent the request to {first.answer}, "
                          f"the rule sends it to {first.expected}; {_differ(len(wrong))} {where}",
            max_diff=float(unused), first_mismatch=index))
    if run.outputs is None:
        return report(CheckResult("FAIL", name, f"{where}: {run.stopped}"))
    placed = Counter(o.metrics.decode_worker for o in run.outputs)
    chosen = Counter(d.answer for d in router.decisions)
    if placed != chosen:
        return report(CheckResult("FAIL", name, f"{where}: the outputs were decoded on {dict(placed)}, but your "
                                                f"function chose {dict(chosen)}"))
    expected = colocated_tokens(prompts, ROUTE_KV_BLOCKS)
    return report(_tokens_mismatch(name, run.outputs, expected, where) or CheckResult("PASS", name, max_diff=0.0))


def check_decode_has_room(fn: Callable[[list[WorkerView], list[int], int], bool]) -> CheckResult:
    """Run a cluster whose admission asks ``fn(decoders, on_their_way, needed)``, and check what it admitted.

    ``fn`` is first called once on made-up loads (it must return a bool). Then it decides, in
    :data:`CLUSTER` with decode pools of 16 blocks, whether each of a burst of sixteen 33-token prompts
    (3 blocks each: 48 asked of 32) may be prefilled now or must wait in the front end. The cluster must
    not stall (a prompt held back while nothing else runs waits for ever); every decision must be the
    rule's on the same loads (the first that is not is the first mismatch, with what the engine did
    instead; a flipped decision is a difference of 1); and every output must be one colocated engine's.
    """
    name = "decode_has_room"
    probe = ([WorkerView("decode0", 9, 2), WorkerView("decode1", 4, 1)], [3, 2], 5)
    where = (f"in the cluster (1 prefill + 2 decode workers of {ROOM_KV_BLOCKS} blocks, "
             f"{len(ROOM_PROMPT_LENS)} prompts of 3 blocks sent at once)")
    prompts = engine_prompts(ROOM_PROMPT_LENS, seed=52)
    router = ReaderRouter(decode_has_room=fn)
    run, ended = _start(name, fn, lambda: fn(list(probe[0]), list(probe[1]), probe[2]),
                        lambda a: "" if isinstance(a, bool) else
                        f"returned {type(a).__name__} {a!r}; expected True or False", router, prompts,
                        ROOM_KV_BLOCKS, where)
    if run is None:
        return ended  # type: ignore[return-value]
    wrong = [(i, d) for i, d in enumerate(router.decisions) if not d.right]
    if wrong:
        index, first = wrong[0]
        free = [w.free_blocks for w in first.workers]
        if first.answer:
            did = "so the engine sent the prompt to prefill; the rule holds it back in the front end"
        else:
            did = "so the engine held the prompt back in the front end; the rule sends it to prefill"
        ending = f"; {run.stopped}" if run.stopped else ""
        return report(CheckResult(
            "FAIL", name, f"max |diff| 1; first mismatch at admission decision {index} of {len(router.decisions)} "
                          f"(a prompt needing {first.needed} blocks, decode workers with {free} free blocks, "
                          f"{list(first.on_their_way)} blocks of prefills on their way): your function said "
                          f"{first.answer}, {did}; {_differ(len(wrong))}; in all the engine "
                          f"held back {run.held_back} of {len(prompts)} prompts in the front end, and up to "
                          f"{run.most_waiting('prefill')} queued on the prefill worker {where}{ending}",
            max_diff=1.0, first_mismatch=index))
    if run.outputs is None:
        return report(CheckResult("FAIL", name, f"{where}: {run.stopped}"))
    expected = colocated_tokens(prompts, ROOM_KV_BLOCKS)
    return report(_tokens_mismatch(name, run.outputs, expected, where) or CheckResult("PASS", name, max_diff=0.0))
