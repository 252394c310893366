"""The front end every engine shares: prompts in, text deltas out, over any engine core.

An engine core (:class:`CoreProtocol`) knows token ids only: it takes
:class:`~minipd.engine.request.Request` objects and each step reports
:class:`~minipd.engine.request.EngineCoreOutputs`. The :class:`FrontEnd` does the rest, once for
every kind of core — the colocated :class:`~minipd.engine.core.EngineCore`, and the disaggregated
cluster of prefill and decode workers (:class:`~minipd.pd.cluster.ClusterCore`): it checks and
tokenises prompts, hands out request ids and seeds, turns the core's outputs into text deltas and
request metrics (:class:`~minipd.engine.output_processor.OutputProcessor`: detokenising, stop
strings, logprobs), and tells the core to end a request a stop string ended.
"""

from __future__ import annotations

import queue
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from minipd.engine.inputs import PromptInput, encode_prompt
from minipd.engine.output_processor import OutputProcessingError, OutputProcessor, RequestState
from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, Request
from minipd.errors import ParameterError
from minipd.outputs import StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import Tokenizer


def eos_token_ids(model_config: Any, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end a request (unless ``ignore_eos``): the model config's and the tokenizer's."""
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


class CoreProtocol(Protocol):
    """What a front end needs of an engine core (colocated, behind a client, or a cluster of workers)."""

    #: Live requests, by id (ids in use).
    requests: Mapping[str, Request]
    #: Steps run so far.
    num_steps: int

    def add_request(self, request: Request, kv: Any = None) -> None: ...

    def abort_requests(self, request_ids: Iterable[str],
                       reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]: ...

    def step(self) -> EngineCoreOutputs: ...

    def take_failure(self) -> Exception | None: ...

    def has_unfinished_requests(self) -> bool: ...

    def check_fits(self, num_tokens: int, max_tokens: int, what: str = "the request") -> None: ...


class FrontEnd:
    """Text in, deltas out, over an engine ``core``.

    Args:
        core: the engine core (see :class:`CoreProtocol`).
        tokenizer: encodes prompts and decodes outputs.
        max_model_len: the longest sequence a request may grow to.
        eos_token_ids: tokens that end a request (unless ``ignore_eos``).
        vocab_size: token ids in prompts must be below it.
        seed: seeds the draw of seeds for requests that give none.
    """

    def __init__(self, core: CoreProtocol, tokenizer: Tokenizer, max_model_len: int, eos_token_ids: frozenset[int],
                 vocab_size: int, seed: int | None = None) -> None:
        self.core = core
        self.processor = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._seeds = random.Random(seed if seed is not None else time.time_ns())
        self._next_id = 0
        self._abort_requests: queue.SimpleQueue[str] = queue.SimpleQueue()

    # ----------------------------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        """An id no live request has: automatic ids skip ids that callers chose."""
        while True:
            request_id = str(self._next_id)
            self._next_id += 1
            if request_id not in self.processor.states and request_id not in self.core.requests:
                return request_id

    def make_request(self, prompt: PromptInput, params: SamplingParams, index: int = 0,
                     request_id: str | None = None, arrival_time: float | None = None, *,
                     hold_kv: bool = False, num_external_tokens: int = 0) -> RequestState:
        """Check and encode one prompt into a request without queueing it; ``index`` names it in errors.

        ``hold_kv`` keeps the request's blocks after it finishes (for ``export_kv``) until
        ``release_kv``; ``num_external_tokens`` says its first tokens' K/V will be given, not computed.
        """
        ids, text = encode_prompt(self.tokenizer, prompt, index, self.vocab_size, self.max_model_len)
        self.core.check_fits(len(ids), params.max_tokens, what=f"prompts[{index}]")
        if request_id is None:
            request_id = self.new_request_id()
        elif not isinstance(request_id, str) or not request_id:
            raise ParameterError("request_id", f"request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self.processor.states or request_id in self.core.requests:
            raise ParameterError("request_id", f"request_id {request_id!r} is already in use by a running request")
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        state = self.processor.new_state(request_id, text, ids, params, arrival)
        state.request = Request(request_id=request_id, all_token_ids=list(ids), num_prompt_tokens=len(ids),
                                params=params, seed=seed, eos_token_ids=self.eos_token_ids,
                                max_model_len=self.max_model_len, arrival_time=arrival,
                                num_external_tokens=num_external_tokens, hold_kv=hold_kv)
        return state

    def add(self, state: RequestState, kv: Any = None) -> str:
        """Queue a request made by :meth:`make_request` (with its first tokens' K/V, if given); returns its id."""
        if state.request is None:
            raise ValueError("this request state was not made by make_request")
        self._take_abort_requests()  # an abort asked for before this request came in is not this request's
        if state.request_id in self.processor.states:
            raise ParameterError("request_id", f"request_id {state.request_id!r} is already in use by a running "
                                               "request")
        if kv is None:
            self.core.add_request(state.request)
        else:
            self.core.add_request(state.request, kv)
        self.processor.add(state)
        return state.request_id

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Check, encode and queue one prompt; returns the request id to follow it by."""
        return self.add(self.make_request(prompt, params or SamplingParams(), request_id=request_id))

    def watch(self, request_id: str) -> deque[StreamDelta]:
        """Keep every future delta of ``request_id`` in a queue, so several streams can share the engine."""
        return self.processor.watch(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; its stream ends with an ``"abort"`` delta.

        A finished ``hold_kv`` request's blocks are released. Returns False if there was nothing to stop or free.
        """
        live = request_id in self.processor.states or request_id in self.core.requests
        self._abort_now([request_id])
        return live

    def request_abort(self, request_id: str) -> None:
        """Ask, from any thread, for ``request_id`` to be aborted by the thread that steps the engine, before it
        applies another step's outputs (the step in progress included): a server's event loop calls it when a
        client hangs up, so the request takes no token the step's thread had not already begun to apply, however
        far behind its workers that thread runs. What it then does is :meth:`abort`'s (unknown ids are ignored)."""
        self._abort_requests.put(request_id)

    def _take_abort_requests(self) -> list[StreamDelta]:
        """Apply the aborts :meth:`request_abort` asked for; their deltas."""
        ids: list[str] = []
        while not self._abort_requests.empty():  # (only this thread takes from it: get_nowait cannot fail)
            ids.append(self._abort_requests.get_nowait())
        return self._abort_now(ids) if ids else []

    def _abort_now(self, request_ids: list[str]) -> list[StreamDelta]:
        """End ``request_ids`` in the core (it ignores the ones it does not know) and deliver their last deltas.

        A request the core has already let go of, whose last output is not handed out yet (the step that made
        its last tokens finished it there), ends here all the same: as aborted, that output finding it ended
        when it comes. A client that hung up is sent nothing after its abort (a disaggregated cluster can hand
        over several tokens at once there, kept back for a transfer report)."""
        outputs = list(self.core.abort_requests(request_ids))
        ended = {out.request_id for out in outputs}
        for request_id in dict.fromkeys(request_ids):
            state = self.processor.states.get(request_id)
            if request_id not in ended and state is not None and not state.finished \
                    and request_id not in self.core.requests:
                m = state.metrics  # (kept as they are: an output's counters replace the request's)
                outputs.append(EngineCoreOutput(request_id, [], FinishReason.ABORT, None, m.cached_tokens,
                                                m.preemptions, m.prefill_tokens))
        return self._deliver(EngineCoreOutputs(outputs, time.perf_counter()))

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (or has an output still to apply)."""
        return self.core.has_unfinished_requests() or self.processor.has_pending()

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Run one step of the core; return a delta for every request that got a token or finished.

        A failure is raised only once nothing of the step is lost (see
        :meth:`StepCore.step <minipd.engine.step_core.StepCore.step>` and :meth:`OutputProcessor.process`):
        its tokens are delivered to their requests (and streams) first, so calling ``step`` again goes on as
        if it had not failed. The deltas of a step that raises are not returned: they are in the requests'
        states and :meth:`watch` queues (and in ``OutputProcessingError.deltas``).
        """
        outputs = self.core.step()
        deltas = self._take_abort_requests()  # those asked for while the core stepped: before its tokens
        deltas += self._deliver(outputs)
        failure = self.core.take_failure()
        if failure is not None:
            raise failure
        return deltas

    def _deliver(self, outputs: EngineCoreOutputs) -> list[StreamDelta]:
        try:
            deltas, to_abort = self.processor.process(outputs)
        except OutputProcessingError as err:  # the others were delivered; these end in the core too
            self.core.abort_requests(err.to_abort, FinishReason.STOP)
            self.core.abort_requests(err.failed, FinishReason.ABORT)
            raise
        if to_abort:  # a stop string ended these in the front end: the core must end them too
            self.core.abort_requests(to_abort, FinishReason.STOP)
        return deltas
