"""The in-process engine: an :class:`~minipd.engine.core.EngineCore` with its front end beside it.

``add_request`` / ``step`` / ``abort`` is the engine-level API that streaming, the chapters and
:class:`~minipd.llm.LLM` build on. Prompts are checked and tokenised here, request ids handed out,
and the core's token-id outputs turned into text deltas by the
:class:`~minipd.engine.output_processor.OutputProcessor`. The same core can instead run behind
queues in a thread or another process (:mod:`minipd.engine.core_client`).
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from pathlib import Path

import torch

from minipd.engine.config import EngineConfig
from minipd.engine.core import CPU_KV_MEMORY, EngineCore
from minipd.engine.inputs import PromptInput, encode_prompt
from minipd.engine.output_processor import OutputProcessingError, OutputProcessor, RequestState
from minipd.engine.request import EngineCoreOutputs, FinishReason, Request
from minipd.engine.scheduler import Scheduler
from minipd.engine.stats import StepStats
from minipd.kv.block_manager import BlockManager
from minipd.kv.paged_pool import PackedKV, PagedKVPool
from minipd.models.decoder import DecoderModel
from minipd.outputs import StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import Tokenizer

__all__ = ["CPU_KV_MEMORY", "Engine"]


class Engine:
    """A continuous-batching engine over a paged KV cache for one model, with text in and out."""

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, max_model_len: int,
                 eos_token_ids: frozenset[int], seed: int | None = None) -> None:
        self.core = EngineCore(model, config, max_model_len)
        self.processor = OutputProcessor(tokenizer)
        self.model = self.core.model  # the engine's own view of ``model`` (see EngineCore)
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._seeds = random.Random(seed if seed is not None else time.time_ns())
        self._next_id = 0
        if config.snapshot_interval and config.snapshot_path is not None:
            from minipd.engine.snapshot import SnapshotError, is_snapshot

            path = Path(config.snapshot_path)
            if path.is_symlink() or (path.exists() and not is_snapshot(path)):
                # Said now, not at every interval from inside step(), after that step's tokens.
                raise SnapshotError(f"snapshot_path {path} exists and is not a minipd snapshot; it would not be "
                                    "replaced: choose a new path")

    # The core's parts, for the chapters and tests that look inside.
    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.core.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype."""
        return self.core.dtype

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler."""
        return self.core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        """The core's block manager."""
        return self.core.block_manager

    @property
    def pool(self) -> PagedKVPool:
        """The core's paged KV pool."""
        return self.core.pool

    @property
    def step_stats(self) -> deque[StepStats]:
        """The most recent steps' records (up to ``stats_history``)."""
        return self.core.step_stats

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens of K/V the pool holds."""
        return self.core.kv_capacity_tokens

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

        ``hold_kv`` keeps the request's blocks after it finishes (for :meth:`export_kv`) until
        :meth:`release_kv`; ``num_external_tokens`` says its first tokens' K/V will be given, not computed.
        """
        ids, text = encode_prompt(self.tokenizer, prompt, index, self.core.model.config.vocab_size,
                                  self.max_model_len)
        self.core.check_fits(len(ids), params.max_tokens, what=f"prompts[{index}]")
        if request_id is None:
            request_id = self.new_request_id()
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self.processor.states or request_id in self.core.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request")
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        state = self.processor.new_state(request_id, text, ids, params, arrival)
        state.request = Request(request_id=request_id, all_token_ids=list(ids), num_prompt_tokens=len(ids),
                                params=params, seed=seed, eos_token_ids=self.eos_token_ids,
                                max_model_len=self.max_model_len, arrival_time=arrival,
                                num_external_tokens=num_external_tokens, hold_kv=hold_kv)
        return state

    def add(self, state: RequestState, kv: PackedKV | None = None) -> str:
        """Queue a request made by :meth:`make_request` (with its first tokens' K/V, if given); returns its id."""
        if state.request is None:
            raise ValueError("this request state was not made by make_request")
        if state.request_id in self.processor.states:
            raise ValueError(f"request_id {state.request_id!r} is already in use by a running request")
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
        self._deliver(EngineCoreOutputs(self.core.abort_requests([request_id]), time.perf_counter()))
        return live

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (or has an output still to apply)."""
        return self.core.has_unfinished_requests() or self.processor.has_pending()

    # --------------------------------------------------------------------------------- KV moves
    def export_kv(self, request_id: str, num_tokens: int | None = None) -> PackedKV:
        """The K/V of a request (running, or finished with ``hold_kv``), packed per layer."""
        return self.core.export_kv(request_id, num_tokens)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_kv`` request kept."""
        return self.core.release_kv(request_id)

    # ---------------------------------------------------------------------------------- snapshots
    def save_snapshot(self, path: str | os.PathLike) -> Path:
        """Write every unfinished request and its K/V to the folder ``path`` (see :mod:`minipd.engine.snapshot`)."""
        from minipd.engine.snapshot import save_snapshot

        return save_snapshot(self, path)

    def load_snapshot(self, path: str | os.PathLike) -> list[str]:
        """Re-admit the requests of a snapshot taken with the same model and KV format; returns their ids.

        Draining the engine then gives the outputs an uninterrupted run would have given.
        """
        from minipd.engine.snapshot import load_snapshot

        return load_snapshot(self, path)

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Run one scheduling step; return a delta for every request that got a token or finished.

        A failure is raised only once nothing of the step is lost (see :meth:`EngineCore.step` and
        :meth:`OutputProcessor.process`): its tokens are delivered to their requests (and streams)
        first, so calling ``step`` again goes on as if it had not failed. The deltas of a step that raises
        are not returned: they are in the requests' states and :meth:`watch` queues (and in
        ``OutputProcessingError.deltas``).
        """
        before = self.core.num_steps
        deltas = self._deliver(self.core.step())
        failure = self.core.take_failure()
        if failure is not None:
            raise failure
        interval = self.config.snapshot_interval
        if interval and self.core.num_steps != before and self.core.num_steps % interval == 0:
            self.save_snapshot(self.config.snapshot_path)  # type: ignore[arg-type]
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
