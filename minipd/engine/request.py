"""A request as the engine core sees it: plain, picklable state, and what each step reports about it.

Everything here can cross a process boundary: token ids as one growing list, the block table, how
many tokens have K/V computed, the sampling parameters, and the seed from which the RNG of every
sampled token is derived (so sampling resumes anywhere — in another process, after a preemption,
on another worker). Text, detokenisation and stop strings are the front end's business
(:mod:`minipd.engine.output_processor`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from minipd.kv.block_manager import BlockAllocation
from minipd.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # not scheduled yet, or preempted and waiting to be recomputed
    #: Blocks allocated; the K/V of its first ``num_external_tokens`` tokens are arriving from elsewhere.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    #: Finished, but its blocks are kept (e.g. until a decode worker has read them) until released.
    FINISHED_HOLDING_KV = "finished_holding_kv"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; compares equal to the plain strings of :class:`~minipd.outputs.RequestOutput`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)  # a request is itself, not its contents: two identical prompts are two requests
class Request:
    """Everything the engine core tracks for one request, from arrival to finish."""

    request_id: str
    #: Prompt tokens, then every output token, in one list that grows by one per step.
    all_token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    #: Seeds the RNG of each sampled token together with its index (see ``sampling_offset``).
    seed: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    #: Tokens (prompt, then output) whose K/V are in the cache.
    num_computed_tokens: int = 0
    blocks: BlockAllocation = field(default_factory=BlockAllocation)
    #: Chained hashes of the request's full blocks, computed once and extended as it grows.
    block_hashes: list[bytes] = field(default_factory=list)
    #: Leading tokens whose K/V come from elsewhere (another worker) instead of being computed.
    num_external_tokens: int = 0
    #: Keep the blocks after finishing (status FINISHED_HOLDING_KV) until the core is told to release them.
    hold_kv: bool = False
    finish_reason: FinishReason | None = None
    #: The stop token id that ended the request, if one did.
    stop_reason: int | None = None
    first_scheduled_time: float | None = None
    #: Prompt tokens found in the prefix cache, summed over every (re)admission.
    num_cached_tokens: int = 0
    #: Times the request lost its KV blocks to a newer one and was recomputed.
    num_preemptions: int = 0
    #: Prompt tokens computed by prefill.
    num_prefill_tokens: int = 0
    #: Prompt tokens whose log-probabilities were reported (``prompt_logprobs``): a recomputation after
    #: preemption does not report them twice.
    num_prompt_logprobs_done: int = 1
    #: Prompt log-probabilities computed but not reported yet (they go out with the first token).
    pending_prompt_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's tokens (a copy)."""
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far (a copy)."""
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def sampling_offset(self) -> int:
        """Index of the next token to sample: with ``seed``, all the RNG state that token needs."""
        return self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request has a finish reason (holding KV or not)."""
        return self.finish_reason is not None

    def is_decode(self, num_new: int) -> bool:
        """Whether computing ``num_new`` tokens now is a decode step: the one token sampled last."""
        if num_new != 1:
            return False
        num_tokens = len(self.all_token_ids)  # (asked for every row of every step: no property calls)
        return self.num_computed_tokens + 1 == num_tokens and num_tokens > self.num_prompt_tokens

    def samples_after(self, num_new: int) -> bool:
        """Whether computing ``num_new`` more tokens now reaches the end of the sequence, so that a next
        token is sampled (not so for a prefill chunk short of the prompt's end). Asked before the step."""
        return self.num_computed_tokens + num_new == len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V still have to be computed before the next token can be sampled."""
        return len(self.all_token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        """Record a new token and set ``finish_reason`` when it ends the request (stop token or length)."""
        self.all_token_ids.append(token_id)
        params = self.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish(FinishReason.STOP, token_id)
        elif params.stop_token_ids and token_id in params.stop_token_ids:
            self.finish(FinishReason.STOP, token_id)
        elif (num_tokens := len(self.all_token_ids)) - self.num_prompt_tokens >= params.max_tokens \
                or num_tokens >= self.max_model_len:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        """End the request; the scheduler decides what happens to its blocks."""
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass
class EngineCoreOutput:
    """What one step (or an abort) reports about one request; plain data, cheap to send between processes."""

    request_id: str
    #: Tokens produced for the request since the last report (one per step; none for an abort).
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    #: The stop token that ended the request (or, for an abort by failure, what failed).
    stop_reason: int | str | None = None
    #: Counters the front end keeps in the request's metrics.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    first_scheduled_time: float | None = None
    #: ``logprobs``: for each new token, its log-probability and the top ones ({token id: logprob}).
    new_logprobs: list[dict[int, float]] | None = None
    #: ``prompt_logprobs``: the same for prompt tokens computed this step, in order.
    new_prompt_logprobs: list[dict[int, float]] | None = None
    #: Disaggregated serving: :class:`~minipd.outputs.RequestMetrics` fields the cluster set since the last
    #: output (the workers that served the request, its KV transfer), for the front end to copy.
    route: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """True for the request's last report."""
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """Everything one step of the core produced, stamped with when it produced it."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0
    #: Tokens the step computed (0: nothing could run, e.g. every request waits for K/V from elsewhere).
    num_scheduled_tokens: int = 0
