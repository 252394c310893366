"""``AsyncLLM``: the engine for asyncio code — a server, or any program with many requests in flight.

One thread owns the engine: it takes requests and aborts from a queue, steps the engine while there
is work, and hands each request's deltas to that request's ``asyncio.Queue`` through one FIFO per
event loop, which the loop drains (woken by ``loop.call_soon_threadsafe``). The event loop never runs a
step, so it stays responsive however long a step takes; many coroutines can each ``async for`` over
their own request.

It runs over a colocated :class:`~minipd.llm.LLM` or a :class:`~minipd.pd.llm.DisaggregatedLLM`, with
the same semantics: cancelling the task that consumes a request, or closing its generator, aborts the
request in the engine (on whichever worker holds it) at the owner thread's next turn, and its KV
blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

from minipd.engine.inputs import PromptInput, normalize_params, normalize_prompts
from minipd.errors import ParameterError
from minipd.outputs import StreamDelta
from minipd.sampling_params import SamplingParams

logger = logging.getLogger("minipd")

#: How long the owner thread waits for a request when the engine has nothing to do (it checks for
#: shutdown, and a disaggregated engine hears its workers' heartbeats, this often).
IDLE_WAIT = 0.05
#: Steps that fail one after another before the requests in flight are ended with the error.
MAX_FAILED_STEPS = 3


class EngineStoppedError(RuntimeError):
    """The engine behind an :class:`AsyncLLM` stopped (shut down, or its steps kept failing)."""


class _Engine:
    """The engine of an ``LLM`` or a ``DisaggregatedLLM`` (one front end over its core), stepped under the
    object's own lock, so its synchronous API stays usable beside this one."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.engine, self.lock = llm, llm.engine, llm._lock
        self.tokenizer = llm.tokenizer
        core = self.engine.core
        if hasattr(core, "step_timeout"):
            # A cluster's step waits for its workers' messages: briefly, so that requests and aborts
            # queued meanwhile get in at once.
            core.step_timeout = min(core.step_timeout, 0.005)

    def submit(self, prompt: PromptInput, params: SamplingParams, request_id: str | None,
               arrival_time: float | None) -> tuple[str, deque]:
        with self.lock:
            state = self.engine.make_request(prompt, params, request_id=request_id, arrival_time=arrival_time)
            self.engine.add(state)
            return state.request_id, self.engine.watch(state.request_id)

    def step(self) -> None:
        with self.lock:
            self.engine.step()

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.engine.abort(request_id)

    def request_abort(self, request_id: str) -> None:
        """From any thread, without the lock: applied before the step in progress hands out its tokens."""
        self.engine.request_abort(request_id)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def close(self) -> None:
        self.llm.close()


class _Mailbox:
    """The owner thread's hand-overs to one event loop, in one FIFO that the loop drains
    ``HAND_OVER_PER_TURN`` batches a turn.

    One queue for every step's batches keeps each request's deltas in order: a step's hand-over that the loop
    has not finished (more streams than one turn takes) is always finished before the next step's begins.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: deque[tuple[asyncio.Queue, list[StreamDelta] | BaseException]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False  # a drain is queued in the loop, or running

    def post(self, items: list[tuple[asyncio.Queue, list[StreamDelta] | BaseException]]) -> None:
        """From the owner thread: queue ``items`` (a consumer's queue, what to put in it) behind earlier ones."""
        with self._lock:
            self._pending.extend(items)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the consumers' loop is closed: nobody to tell
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """In the consumers' loop: up to ``HAND_OVER_PER_TURN`` items, then the rest at the loop's next turns."""
        with self._lock:
            turn = [self._pending.popleft() for _ in range(min(HAND_OVER_PER_TURN, len(self._pending)))]
        for sink, item in turn:
            sink.put_nowait(item)
        with self._lock:
            if not self._pending:
                self._scheduled = False
                return
        asyncio.get_running_loop().call_soon(self._drain)


class _Stream:
    """Where the owner thread sends one request's deltas: its outbox in the engine, its consumer's queue (through
    the mailbox of the consumer's loop)."""

    def __init__(self, mailbox: _Mailbox, sink: asyncio.Queue, outbox: deque) -> None:
        self.mailbox, self.sink, self.outbox = mailbox, sink, outbox


class AsyncLLM:
    """An asyncio front end over one engine (vLLM's ``AsyncLLM`` shape).

    ``AsyncLLM(model, **options)`` builds an :class:`~minipd.llm.LLM` with ``options`` (and shuts it down
    with :meth:`shutdown`); :meth:`from_llm` wraps an existing ``LLM`` or ``DisaggregatedLLM``. Then::

        async for delta in llm.generate("def fib(n):", SamplingParams(max_tokens=32), request_id="r1"):
            print(delta.text, end="")

    Each :class:`~minipd.outputs.StreamDelta` carries its token, the text it completed, its
    log-probabilities when asked for, and ``.output`` (the request so far).
    """

    def __init__(self, model: str = "tiny-py", **options: Any) -> None:
        from minipd.llm import LLM

        self._start(LLM(model, **options), owned=True)

    @classmethod
    def from_llm(cls, llm: Any, owned: bool = False) -> AsyncLLM:
        """Serve ``llm`` (an ``LLM`` or a ``DisaggregatedLLM``); with ``owned``, :meth:`shutdown` shuts it down too."""
        self = cls.__new__(cls)
        self._start(llm, owned)
        return self

    def _start(self, llm: Any, owned: bool) -> None:
        self.llm = llm
        self._engine = _Engine(llm)
        self._owned = owned
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}  # (owner thread only)
        self._stopped: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="minipd-async-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        """The tokenizer requests are encoded and decoded with."""
        return self._engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The tokenizer requests are encoded and decoded with (vLLM's name)."""
        return self._engine.tokenizer

    @property
    def is_running(self) -> bool:
        """Whether the engine's thread is serving."""
        return self._thread.is_alive() and self._stopped is None

    # ------------------------------------------------------------------------------------ API
    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       arrival_time: float | None = None) -> AsyncIterator[StreamDelta]:
        """Send ``prompt`` to the engine and yield its deltas as they come, the last one finished.

        Bad input raises here (a ``ValueError`` naming the field), before anything is queued. Cancelling
        the consuming task, or closing this generator, aborts the request in the engine. ``arrival_time``
        (``time.perf_counter()``, by default now, when the engine's thread takes the request) is when the
        request arrived: a server passes when the HTTP request did, so latencies count the whole wait.
        """
        if not self.is_running:
            raise EngineStoppedError("this AsyncLLM is shut down") from self._stopped
        prompts = normalize_prompts(prompt)
        if len(prompts) != 1:
            raise ParameterError("prompt", f"generate takes one prompt, got {len(prompts)}")
        (params,) = normalize_params(sampling_params, 1)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        admitted: asyncio.Future = loop.create_future()
        self._commands.put(("add", prompts[0], params, request_id, arrival_time, loop, sink, admitted))
        rid = await admitted
        finished = False
        try:
            while True:
                batch = await sink.get()
                if isinstance(batch, BaseException):
                    raise batch
                for delta in batch:
                    finished = delta.finished
                    yield delta
                    if finished:
                        return
        finally:
            if not finished:  # cancelled, closed, or failed: nothing should keep computing for nobody
                self._engine.request_abort(rid)  # at once, even mid-step
                self._commands.put(("abort", rid))  # and, in turn, the stream's end

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (one id or several); their generators end with an ``"abort"`` delta."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise ParameterError("request_id", f"request_id must be a string or a list of strings, got {request_id!r}")
        for rid in ids:
            self._engine.request_abort(rid)
            self._commands.put(("abort", rid))

    def shutdown(self) -> None:
        """Stop the engine's thread (requests in flight end with an error), and the engine if it is owned."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout=30)
        if self._owned:
            self._owned = False
            self._engine.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    # ------------------------------------------------------------------------- the owner thread
    def _run(self) -> None:
        failures = 0
        try:
            while True:
                wait = 0.0 if self._engine.busy() else IDLE_WAIT
                while True:
                    try:
                        command = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if command[0] == "stop":
                        raise EngineStoppedError("this AsyncLLM was shut down")
                    self._handle(command)
                    wait = 0.0
                if not self._engine.busy():
                    # Another caller of the same engine (a second AsyncLLM, the LLM's own generate) may have
                    # stepped our requests to their end: hand over what it left in their outboxes.
                    self._route()
                    continue
                try:
                    self._engine.step()
                    failures = 0
                except Exception as err:  # a step is rolled back or delivered whole: stepping on is safe
                    failures += 1
                    logger.warning("engine step failed (%d in a row): %s: %s", failures, type(err).__name__, err)
                    if failures >= MAX_FAILED_STEPS:
                        self._fail_all(err)
                        failures = 0
                self._route()
        except BaseException as err:
            self._stopped = err
            self._fail_all(err if isinstance(err, EngineStoppedError) else EngineStoppedError(str(err)))

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, prompt, params, request_id, arrival_time, loop, sink, admitted = command
            try:
                rid, outbox = self._engine.submit(prompt, params, request_id, arrival_time)
            except Exception as err:
                loop.call_soon_threadsafe(_settle, admitted, None, err)
                return
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                # A new loop (each ``asyncio.run`` makes one): forget those closed since.
                self._mailboxes = {old: box for old, box in self._mailboxes.items() if not old.is_closed()}
                mailbox = self._mailboxes[loop] = _Mailbox(loop)
            self._streams[rid] = _Stream(mailbox, sink, outbox)
            loop.call_soon_threadsafe(_settle, admitted, rid, None, self._commands)
        elif command[0] == "abort":
            if command[1] in self._streams:
                self._engine.abort(command[1])
                self._route()

    def _route(self) -> None:
        """Hand every request's new deltas to its consumer: one hand-over per event loop per step, which puts
        each request's batch in its queue (one wake-up of the loop for 200 streams, not 200)."""
        by_mailbox: dict[_Mailbox, list[tuple[asyncio.Queue, list[StreamDelta] | BaseException]]] = {}
        for rid, stream in list(self._streams.items()):
            if not stream.outbox:
                continue
            batch = list(stream.outbox)
            stream.outbox.clear()
            if batch[-1].finished:
                del self._streams[rid]
            by_mailbox.setdefault(stream.mailbox, []).append((stream.sink, batch))
        for mailbox, items in by_mailbox.items():
            mailbox.post(items)

    def _fail_all(self, err: BaseException) -> None:
        """End every request in flight with ``err`` (the engine cannot serve them), after what it already got."""
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            with contextlib.suppress(Exception):
                self._engine.abort(rid)
            stream.mailbox.post([(stream.sink, err)])


#: Requests whose consumers one turn of the event loop wakes: the rest wait for its next turn, so a timer or
#: a new connection waits for a few dozen streams' work, not for every stream's.
HAND_OVER_PER_TURN = 16


def _settle(future: asyncio.Future, result: Any, error: BaseException | None,
            commands: queue.SimpleQueue | None = None) -> None:
    """In the consumer's loop: resolve a submission; a request whose consumer gave up meanwhile is aborted."""
    if future.cancelled():
        if error is None and commands is not None:
            commands.put(("abort", result))
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


__all__ = ["AsyncLLM", "EngineStoppedError"]
