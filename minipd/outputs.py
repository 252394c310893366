"""What a finished (or streaming) request returns: :class:`RequestOutput` and its metrics."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class KVTimeline:
    """Measured events of one disaggregated request's prefill and K/V transfer, for drawing them.

    All times are ``time.perf_counter`` seconds; the workers' clocks agree only when they run on one
    machine (as in the course). ``layers[i]`` is when layer ``i`` of the step that finished the prefill
    computed (on the prefill worker); ``sends`` are the transfers the prefill worker started, as
    ``(layer, start, end)`` of the call that posted each (``layer`` is None for all layers at once);
    ``transfer`` is from the first byte's start to when the receiver had them all.
    """

    mode: str
    prefill_step: tuple[float, float] | None = None
    layers: list[tuple[float, float]] = field(default_factory=list)
    sends: list[tuple[int | None, float, float]] = field(default_factory=list)
    transfer: tuple[float, float] | None = None


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter`` seconds) of one request's life and the latencies they give.

    TTFT (time to first token) is set by prefill; TPOT (time per output token) by decode.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    #: When each output token was produced, in order.
    token_times: list[float] = field(default_factory=list)
    #: How many prompt tokens were computed by prefill.
    prefill_tokens: int = 0
    #: Prompt tokens whose K/V came from the prefix cache, summed over every time it was (re)admitted.
    cached_tokens: int = 0
    #: How many times the request lost its KV blocks to a newer one and was recomputed.
    preemptions: int = 0
    #: Disaggregated serving: KV bytes moved from the prefill to the decode worker, when the move
    #: started and ended, and which workers served the request.
    kv_transfer_bytes: int = 0
    kv_transfer_start: float | None = None
    kv_transfer_end: float | None = None
    #: Push and layer-wise transfers: the share of the transfer's span (first write to last completion) that
    #: lay before the prefill step ended — transfer latency the decode worker does not wait for.
    kv_transfer_hidden: float | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    #: Disaggregated serving: the prefill's layers and the K/V transfer as measured events (None elsewhere).
    kv_timeline: KVTimeline | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive output tokens (one fewer than the tokens)."""
        return [b - a for a, b in pairwise(self.token_times)]

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None with fewer than two tokens."""
        gaps = self.inter_token_latencies
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one request, in the order the prompts were given.

    ``finish_reason`` is ``"stop"`` (end-of-sequence, a stop token or a stop string),
    ``"length"`` (max_tokens or the model's context reached) or ``"abort"`` (aborted by the caller);
    None while still running.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    #: The stop string or stop token id that ended the request, if one did.
    stop_reason: str | int | None = None
    #: With ``SamplingParams(logprobs=k)``: for each generated token, {token id: log-probability} holding
    #: the generated token and the k most likely ones (the model's raw distribution, before temperature).
    logprobs: list[dict[int, float]] | None = None
    #: With ``prompt_logprobs=k``: the same for each prompt token (None for the first, which has no context).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class StreamDelta:
    """One step of a streamed request: the new token and the text it completed.

    The last delta of an aborted request carries no token (``token_id`` None, ``finish_reason``
    ``"abort"``). Text that could still become a stop string is held back until it cannot.
    """

    request_id: str
    token_id: int | None
    #: Text that became printable with this token (may be empty while a character is incomplete
    #: or while it could still be the start of a stop string).
    text: str
    finish_reason: str | None
    _snapshot: Callable[[], RequestOutput] = field(repr=False, compare=False)
    #: With ``SamplingParams(logprobs=k)``: this token's {token id: log-probability} (the token and the k
    #: most likely), so a stream reads its log-probabilities at O(1) per token, without ``output``.
    logprobs: dict[int, float] | None = None

    @property
    def finished(self) -> bool:
        """True for the request's last delta."""
        return self.finish_reason is not None

    @property
    def output(self) -> RequestOutput:
        """The whole request so far (built on access, so streaming stays cheap); final once finished."""
        return self._snapshot()


class RequestStream(Iterator[StreamDelta]):
    """The deltas of one streamed request, in order; ``request_id`` names it (for abort) from the start.

    The request is already queued when the stream is made. Closing the stream (or dropping it)
    before its last delta aborts the request and frees its blocks.
    """

    def __init__(self, request_id: str, deltas: Generator[StreamDelta, None, None],
                 on_close: Callable[[], object]) -> None:
        self.request_id = request_id
        self._deltas = deltas
        self._on_close: Callable[[], object] | None = on_close

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamDelta:
        return next(self._deltas)

    def close(self) -> None:
        """Stop following the request; abort it if it is still running."""
        self._deltas.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to free
            pass
