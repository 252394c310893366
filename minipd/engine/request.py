"""A request inside the engine: its prompt, parameters, generated tokens, text and finish state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minipd.kv.block_manager import BlockAllocation
from minipd.outputs import RequestMetrics, RequestOutput
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # not scheduled yet, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


@dataclass
class Request:
    """Everything the engine tracks for one request from arrival to finish."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    max_model_len: int
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    status: RequestStatus = RequestStatus.WAITING
    #: Tokens (prompt, then output) whose K/V are in the cache.
    num_computed_tokens: int = 0
    blocks: BlockAllocation = field(default_factory=BlockAllocation)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens, in order."""
        return self.prompt_token_ids + self.token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.prompt_token_ids) + len(self.token_ids)

    def is_decode(self, num_new: int) -> bool:
        """Whether computing ``num_new`` tokens now is a decode step: the one token sampled last."""
        return num_new == 1 and self.num_computed_tokens + 1 == self.num_tokens and bool(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V still have to be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int, now: float) -> str:
        """Record a new token; return its text delta and set ``finish_reason`` when the request ends."""
        self.token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)
        params = self.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish("stop", token_id, now)
        elif params.stop_token_ids and token_id in params.stop_token_ids:
            self._finish("stop", token_id, now)
        elif len(self.token_ids) >= params.max_tokens or self.num_tokens >= self.max_model_len:
            self._finish("length", None, now)
        delta = self.detokenizer.add(token_id, last=self.finish_reason is not None)
        if delta and params.stop_strings:
            return self._cut_at_stop_string(delta, now)
        self.text += delta
        return delta

    def _cut_at_stop_string(self, delta: str, now: float) -> str:
        # A stop string may straddle the old text and the delta, so search a window that covers both.
        longest = max(len(s) for s in self.params.stop_strings)
        start = max(0, len(self.text) - longest + 1)
        window = self.text[start:] + delta
        hits = [(window.find(s), s) for s in self.params.stop_strings if s in window]
        if not hits:
            self.text += delta
            return delta
        offset, stop = min(hits)
        cut = start + offset
        emitted = max(0, cut - len(self.text))
        self.text = (self.text + delta)[:cut]
        self._finish("stop", stop, now)
        return delta[:emitted]

    def abort(self, now: float) -> None:
        """End the request where it is, with finish reason ``"abort"``."""
        self._finish("abort", None, now)

    def _finish(self, reason: str, stop_reason: str | int | None, now: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finish_time = now

    def to_output(self) -> RequestOutput:
        """A snapshot of the request as the public :class:`RequestOutput`."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            stop_reason=self.stop_reason,
        )
