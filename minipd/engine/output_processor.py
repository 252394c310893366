"""The front end's half of a request: text, stop strings, metrics and :class:`~minipd.outputs.RequestOutput`.

The engine core reports token ids; this module turns them into what a caller reads. It keeps one
:class:`RequestState` per request — the incremental detokeniser, the text emitted so far, the
timestamps — and turns each step's :class:`~minipd.engine.request.EngineCoreOutputs` into
:class:`~minipd.outputs.StreamDelta` objects. Because it only needs those plain outputs, it works
the same whether the core runs in this process or in another one.

Stop strings are found here: a streamed delta never shows text that could still turn out to be
the start of a stop string; it is held back until it cannot, and dropped if it does.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, Request
from minipd.engine.stats import RequestCounters
from minipd.outputs import RequestMetrics, RequestOutput, StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("minipd")

#: The request metrics a disaggregated cluster reports with outputs (``EngineCoreOutput.route``).
ROUTE_FIELDS = frozenset({"prefill_worker", "decode_worker", "kv_transfer_bytes", "kv_transfer_start",
                          "kv_transfer_end", "kv_transfer_hidden", "kv_timeline"})


@dataclass(eq=False)
class RequestState:
    """What the front end keeps for one request while it runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    #: Text already emitted to the caller.
    text: str = ""
    #: Decoded text not emitted yet because it might be the start of a stop string.
    held: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    #: Deltas kept for a consumer that follows this request (see :meth:`OutputProcessor.watch`).
    outbox: deque[StreamDelta] | None = None
    #: The core's own request object, when the core runs in this process (chapters look inside it).
    request: Request | None = None
    #: ``logprobs`` / ``prompt_logprobs``, when asked for: see :class:`RequestOutput`.
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.finish_reason is not None

    def to_output(self) -> RequestOutput:
        """A snapshot of the request as the public :class:`RequestOutput`."""
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids), token_ids=list(self.token_ids),
                             text=self.text, finish_reason=self.finish_reason, metrics=self.metrics,
                             stop_reason=self.stop_reason,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class OutputProcessingError(RuntimeError):
    """Some of a step's outputs could not be applied; every other one was (its ``deltas`` delivered).

    ``errors`` maps each request that failed to its error; ``failed`` lists those ended for good
    (the core must abort them), ``to_abort`` those a stop string ended (the core must stop them)."""

    def __init__(self, errors: dict[str, Exception], deltas: list[StreamDelta], to_abort: list[str],
                 failed: list[str]) -> None:
        first_id, first = next(iter(errors.items()))
        super().__init__(f"the output of request {first_id!r} could not be applied: {type(first).__name__}: "
                         f"{first}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        self.errors, self.deltas, self.to_abort, self.failed = errors, deltas, to_abort, failed


def _checkpoint(state: RequestState) -> Callable[[], None]:
    """A function that puts ``state`` back as it is now (everything :meth:`OutputProcessor._apply` changes)."""
    # O(1) per output (this runs for every token): lists that only grow are saved as their lengths.
    metrics = dict(vars(state.metrics))
    detokenizer = state.detokenizer
    saved = (len(state.token_ids), state.text, state.held, state.logprobs, state.prompt_logprobs,
             state.finish_reason, state.stop_reason, len(detokenizer.token_ids), detokenizer.prefix_offset,
             detokenizer.read_offset, len(state.metrics.token_times))

    def restore() -> None:
        (num_tokens, state.text, state.held, state.logprobs, state.prompt_logprobs, state.finish_reason,
         state.stop_reason, num_detokenized, detokenizer.prefix_offset, detokenizer.read_offset, num_times) = saved
        del state.token_ids[num_tokens:]
        del detokenizer.token_ids[num_detokenized:]
        del state.metrics.token_times[num_times:]
        vars(state.metrics).update(metrics)  # in place: outputs already handed out share this object

    return restore


class OutputProcessor:
    """Turns the core's token-id outputs into text deltas and finished :class:`RequestOutput` objects."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        #: Prompt and generated tokens, and finished requests by reason, over every request served.
        self.counters = RequestCounters()
        #: Called as ``callback(metrics, finish_reason)`` when a request ends, whoever reads its output (a
        #: server's latency histograms: a client that left early must not drop a finished request's record).
        self.finished_callbacks: list[Callable[[RequestMetrics, str], None]] = []
        #: Outputs that wait to be applied, by request and in order, each with its step's timestamp and whether
        #: it failed already: the first failed, those after it wait behind it. Tried again next call.
        self._retry: dict[str, list[tuple[EngineCoreOutput, float, bool]]] = {}

    def new_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                  arrival_time: float) -> RequestState:
        """A fresh state for a request (not registered until :meth:`add`)."""
        return RequestState(request_id, prompt, prompt_token_ids, params,
                            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                            RequestMetrics(arrival_time=arrival_time))

    def add(self, state: RequestState) -> None:
        """Follow ``state``'s request from now on."""
        self.states[state.request_id] = state
        self.counters.prompt_tokens += len(state.prompt_token_ids)

    def watch(self, request_id: str) -> deque[StreamDelta]:
        """Keep every future delta of ``request_id`` in a queue, so several streams can share the engine."""
        state = self.states[request_id]
        if state.outbox is None:
            state.outbox = deque()
        return state.outbox

    def replay(self, state: RequestState, token_ids: list[int]) -> None:
        """Rebuild the text of a restored request from the tokens it had produced (its metrics stay as saved)."""
        for token_id in token_ids:
            state.token_ids.append(token_id)
            state.held += state.detokenizer.add(token_id)
        self._release_text(state)

    def has_pending(self) -> bool:
        """Whether outputs that failed to apply wait to be tried again (see :meth:`process`)."""
        return bool(self._retry)

    def process(self, outputs: EngineCoreOutputs) -> tuple[list[StreamDelta], list[str]]:
        """Apply one step's outputs; return the deltas and the ids the core must abort (stop string hit).

        Each request's output is applied whole or not at all. One that raises (a detokeniser error, say)
        leaves its request as it was, every other output is applied and delivered, and then
        :class:`OutputProcessingError` is raised; the failed output is tried again first at the next call
        (so a passing fault loses nothing; a later output of the same request waits behind it, in order), and
        a request whose output fails twice ends with ``"abort"`` (its ``stop_reason`` says why) and is named in
        the error for the core to abort.
        """
        deltas: list[StreamDelta] = []
        to_abort: list[str] = []
        errors: dict[str, Exception] = {}
        failed: list[str] = []
        retry, self._retry = self._retry, {}
        items = [item for waiting in retry.values() for item in waiting] + [(out, outputs.timestamp, False)
                                                                           for out in outputs.outputs]
        for out, timestamp, failed_before in items:
            state = self.states.get(out.request_id)
            if state is None or state.finished:
                continue  # already ended here (e.g. a stop string), the core's report comes after
            if out.request_id in self._retry:  # an earlier output of it failed just now: wait behind it, in order
                self._retry[out.request_id].append((out, timestamp, failed_before))
                continue
            restore = _checkpoint(state)
            try:
                delta = self._apply(state, out, timestamp)
            except Exception as err:
                restore()
                errors[out.request_id] = err
                if failed_before:
                    delta = self._end_with_error(state, err, timestamp)
                    failed.append(out.request_id)
                else:
                    self._retry[out.request_id] = [(out, timestamp, True)]
                    continue
            if out.request_id not in errors:  # (applied, not ended by an error)
                self.counters.generation_tokens += len(out.new_token_ids)
            if state.finished:
                del self.states[out.request_id]
                finished = self.counters.finished
                finished[state.finish_reason] = finished.get(state.finish_reason, 0) + 1  # type: ignore[index]
                for callback in self.finished_callbacks:
                    try:
                        callback(state.metrics, state.finish_reason)  # type: ignore[arg-type]
                    except Exception:  # an observer's fault must not cost the request its output
                        logger.exception("a finished-request callback failed")
                if not out.finished and out.request_id not in failed:
                    to_abort.append(out.request_id)
            deltas.append(delta)
            if state.outbox is not None:
                state.outbox.append(delta)
        if errors:
            raise OutputProcessingError(errors, deltas, to_abort, failed)
        return deltas, to_abort

    def _end_with_error(self, state: RequestState, err: Exception, now: float) -> StreamDelta:
        """End a request whose output cannot be applied: finish reason ``"abort"``, the error as stop reason."""
        state.finish_reason, state.stop_reason = "abort", f"{type(err).__name__}: {err}"
        state.metrics.finish_time = now
        return StreamDelta(state.request_id, None, "", state.finish_reason, state.to_output)

    def _apply(self, state: RequestState, out: EngineCoreOutput, now: float) -> StreamDelta:
        m = state.metrics
        m.cached_tokens, m.preemptions, m.prefill_tokens = out.num_cached_tokens, out.num_preemptions, \
            out.num_prefill_tokens
        if m.first_scheduled_time is None:
            m.first_scheduled_time = out.first_scheduled_time
        if out.route:
            for name, value in out.route.items():
                if name in ROUTE_FIELDS:
                    setattr(m, name, value)
        if out.new_logprobs is not None:
            state.logprobs = (state.logprobs or []) + out.new_logprobs
        if state.params.prompt_logprobs is not None and state.prompt_logprobs is None and out.new_token_ids:
            # They come with the first token, once: a request recomputed elsewhere (disaggregated
            # recovery) scores its prompt again.
            state.prompt_logprobs = [None, *(out.new_prompt_logprobs or [])]
        token_id = None
        for token_id in out.new_token_ids:
            state.token_ids.append(token_id)
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            state.held += state.detokenizer.add(token_id, last=out.finished)
        if out.finished:
            state.finish_reason = out.finish_reason.value if out.finish_reason is not None else None
            state.stop_reason = out.stop_reason
        text = self._release_text(state)
        if state.finished:
            m.finish_time = now
        return StreamDelta(state.request_id, token_id, text, state.finish_reason, state.to_output,
                           logprobs=out.new_logprobs[-1] if out.new_logprobs else None)

    @staticmethod
    def _release_text(state: RequestState) -> str:
        """Move what can be shown from ``held`` to ``text``; end the request at a stop string."""
        stops = state.params.stop_strings
        if len(state.token_ids) < state.params.min_tokens:
            stops = []  # as vLLM: nothing stops a request before min_tokens (the sampler masks stop tokens)
        if not stops or not state.held:
            text, state.held = state.held, ""
            state.text += text
            return text
        # A stop string may straddle emitted text and the new text, so search a window covering both.
        longest = max(len(s) for s in stops)
        start = max(0, len(state.text) - longest + 1)
        window = state.text[start:] + state.held
        hits = [(window.find(s), s) for s in stops if s in window]
        if hits:
            offset, stop = min(hits)
            if state.params.include_stop_str_in_output:
                offset += len(stop)
            cut = max(0, start + offset - len(state.text))
            text = state.held[:cut]
            state.text += text
            state.held = ""
            state.finish_reason, state.stop_reason = "stop", stop
            return text
        keep = 0 if state.finished else _held_back(state.text + state.held, stops)
        keep = min(keep, len(state.held))
        text = state.held[:len(state.held) - keep]
        state.held = state.held[len(state.held) - keep:]
        state.text += text
        return text
