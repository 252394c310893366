"""What :class:`~minipd.llm.LLM` and :class:`~minipd.pd.llm.DisaggregatedLLM` offer alike, over one front end.

Both hold a :class:`~minipd.engine.front_end.FrontEnd` (``self.engine``) over their engine core — the
model in this process, or prefill and decode workers — and a lock around it. ``generate``, ``chat``,
``stream`` and ``abort`` are written once, here, so the two behave the same: threads may call them at
once (their requests share the core's steps), a stream's close aborts its request, an interrupted
``generate`` frees what it held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Generator, Iterable, Sequence

from tqdm.auto import tqdm

from minipd.engine.front_end import FrontEnd
from minipd.engine.inputs import PromptInput, normalize_params, normalize_prompts
from minipd.errors import ParameterError
from minipd.outputs import RequestOutput, RequestStream, StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import Tokenizer

logger = logging.getLogger("minipd")


class LLMBase:
    """``generate`` / ``chat`` / ``stream`` / ``abort`` over ``self.engine`` (a :class:`FrontEnd`)."""

    engine: FrontEnd
    tokenizer: Tokenizer
    #: One lock around the engine: threads submit and step in turn, never at once.
    _lock: threading.RLock

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer requests are encoded and decoded with."""
        return self.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for each prompt; one :class:`RequestOutput` per prompt, in the order given.

        ``prompts`` is one string, one list of token ids, or a list of either. ``sampling_params``
        is one :class:`SamplingParams` for all, or one per prompt. Every prompt is checked before
        any runs; all of them are batched together by the engine. Several threads may call
        ``generate`` and ``stream`` on one ``LLM`` at once: their requests share the engine's steps.
        """
        prompt_list = normalize_prompts(prompts)
        params = normalize_params(sampling_params, len(prompt_list))
        now = time.perf_counter()
        with self._lock:
            states = [self.engine.make_request(p, sp, index=i, arrival_time=now)
                      for i, (p, sp) in enumerate(zip(prompt_list, params, strict=True))]
            for state in states:
                self.engine.add(state)
        show = use_tqdm if use_tqdm is not None else len(states) >= 8
        try:
            with tqdm(total=len(states), desc="generating", disable=not show) as bar:
                done = 0
                while done < len(states):
                    with self._lock:
                        # Another thread's step may have finished ours already; step only if not.
                        if not all(s.finished for s in states):
                            self.engine.step()
                        finished = sum(s.finished for s in states)
                    bar.update(finished - done)
                    done = finished
        finally:
            # Interrupted (e.g. KeyboardInterrupt) or a step raised (the step was rolled back or delivered, see
            # Engine.step): free what this call still holds; the LLM stays usable, and calling again recomputes.
            with self._lock:
                for state in states:
                    if not state.finished:
                        try:
                            self.engine.abort(state.request_id)
                        except Exception:  # (another request's output failing again): free the rest all the same
                            logger.exception("aborting request %r after generate stopped", state.request_id)
        return [s.to_output() for s in states]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's ``LLM.chat``: one ``RequestOutput`` per conversation.

        ``messages`` is one conversation (a list of ``{"role": ..., "content": ...}``) or a list of them;
        each is rendered with the tokenizer's chat template (or ``chat_template``) and generated from.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, list) or not conversations:
            raise ParameterError("messages", "messages must be a conversation (a list of {'role', 'content'} "
                                             "dicts) or a non-empty list of them")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, chat_template)  # type: ignore[arg-type]
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> RequestStream:
        """Queue ``prompt`` now and return its :class:`RequestStream`: one :class:`StreamDelta` per token.

        Bad input raises here, before anything is queued; ``stream.request_id`` can be passed to
        :meth:`abort`, which ends the stream with an ``"abort"`` delta. Other requests in the engine
        keep running alongside; closing the stream early aborts this request and frees its blocks.
        """
        prompts = normalize_prompts(prompt)
        if len(prompts) != 1:
            raise ParameterError("prompt", f"stream takes one prompt, got {len(prompts)}; use generate for several")
        (params,) = normalize_params(sampling_params, 1)
        with self._lock:
            state = self.engine.make_request(prompts[0], params)
            self.engine.add(state)
            outbox = self.engine.watch(state.request_id)

        def end() -> None:
            with self._lock:
                if not state.finished:
                    self.engine.abort(state.request_id)

        return RequestStream(state.request_id, self._follow(outbox), end)

    def _follow(self, outbox: deque[StreamDelta]) -> Generator[StreamDelta, None, None]:
        return _Follow(self, outbox)

    def abort(self, request_id: str | Iterable[str]) -> bool | list[str]:
        """Abort requests running in this LLM's engine; their KV blocks are freed at once.

        Takes one id (returns whether it was live) or several, as vLLM's ``abort`` does (returns the ids
        that were live). A :meth:`stream` following an aborted request ends with a final delta whose
        ``finish_reason`` is ``"abort"``.
        """
        if isinstance(request_id, str):
            with self._lock:
                return self.engine.abort(request_id)
        if isinstance(request_id, (bytes, bytearray)) or not isinstance(request_id, Iterable):
            raise ParameterError("request_id", f"request_id must be a string or a list of strings, "
                                               f"got {type(request_id).__name__}")
        ids = list(request_id)
        bad = next((i for i in ids if not isinstance(i, str)), None)
        if bad is not None:
            raise ParameterError("request_id", f"request_id must be a string or a list of strings, got an element "
                                               f"{bad!r} ({type(bad).__name__})")
        with self._lock:
            return [i for i in ids if self.engine.abort(i)]


class _Follow(Generator[StreamDelta, None, None]):
    """A stream's deltas: taken from its request's queue, the engine stepped whenever none is queued.

    Unlike a generator function's, this iterator is not ended by an error: a step that raises passes its
    error to the reader, and reading on goes on where it stopped (the step was rolled back or its tokens
    were delivered into the queue first, see :meth:`Engine.step <minipd.engine.engine.Engine.step>`), so a
    passing fault neither ends the stream early nor loses a delta.
    """

    def __init__(self, llm: LLMBase, outbox: deque[StreamDelta]) -> None:
        self._llm, self._outbox, self._done = llm, outbox, False

    def send(self, value: None) -> StreamDelta:
        """The next delta (``value`` is ignored: nothing is sent into a stream)."""
        if self._done:
            raise StopIteration
        while True:
            with self._llm._lock:  # (taken per step: other streams and generate calls step in between)
                # Another stream's step may already have produced our next token; step only when none is queued.
                if not self._outbox:
                    self._llm.engine.step()
                if self._outbox:
                    delta = self._outbox.popleft()
                    break
        self._done = delta.finished
        return delta

    def throw(self, typ: object, val: object = None, tb: object = None) -> StreamDelta:
        """End the stream with the error thrown in (``close`` throws ``GeneratorExit``)."""
        self._done = True
        err = val if isinstance(val, BaseException) else typ() if isinstance(typ, type) else typ
        raise err  # type: ignore[misc]
