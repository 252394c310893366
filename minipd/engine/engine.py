"""The step loop: schedule, run the model, sample, append tokens, finish requests, record metrics.

``add_request`` / ``step`` / ``abort`` is the engine-level API that streaming, the chapters and the
disaggregated workers build on; :class:`~minipd.llm.LLM` is a thin layer over it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from minipd.engine.config import EngineConfig
from minipd.engine.inputs import PromptInput, check_prompt_ids
from minipd.engine.model_runner import ModelRunner
from minipd.engine.request import Request
from minipd.engine.scheduler import Scheduler
from minipd.engine.stats import StepStats
from minipd.kernels.backend import get_backend
from minipd.kv.block_manager import BlockManager
from minipd.kv.paged_pool import PagedKVPool
from minipd.models.decoder import DecoderModel
from minipd.outputs import RequestMetrics, StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import IncrementalDetokenizer, Tokenizer

#: Default KV budget on CPU: room for ~85k tokens of tiny-py, and quick to allocate.
CPU_KV_MEMORY = 256 << 20


class Engine:
    """A continuous-batching engine over a paged KV cache for one model."""

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, max_model_len: int,
                 eos_token_ids: frozenset[int], seed: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.kernels = get_backend(config.kernel_backend, self.device)
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        self.pool = PagedKVPool(model.config, num_blocks, config.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.scheduling_policy)  # type: ignore[arg-type]
        self.runner = ModelRunner(model, self.pool, self.kernels)
        self.requests: dict[str, Request] = {}
        #: Deltas kept for streamed requests until their consumer takes them (see :meth:`watch`).
        self.outboxes: dict[str, deque[StreamDelta]] = {}
        self.step_stats: list[StepStats] = []
        self._seed_source = torch.Generator().manual_seed(seed if seed is not None else time.time_ns())
        self._ids = itertools.count()

    def _default_num_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free // 2
        else:
            budget = CPU_KV_MEMORY
        blocks = PagedKVPool.blocks_for_budget(self.model.config, budget, cfg.block_size, self.dtype)
        # More than every running sequence at full length can use would only waste memory.
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return min(blocks, useful) if cfg.kv_cache_memory is None else blocks

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens of K/V the pool holds."""
        return self.pool.num_tokens

    # ----------------------------------------------------------------------------------- requests
    def make_request(self, prompt: PromptInput, params: SamplingParams, index: int = 0,
                     request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Check and encode one prompt into a :class:`Request` without queueing it.

        ``index`` names the prompt in error messages (``prompts[index]``).
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompts[{index}] is an empty string: a prompt needs at least one token")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        check_prompt_ids(index, ids, self.model.config.vocab_size, self.max_model_len)
        longest = min(self.max_model_len, len(ids) + params.max_tokens)
        # The last sampled token is never fed back, so its K/V never need a slot.
        blocks = -(-(longest - 1) // self.config.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompts[{index}] may grow to {longest} tokens ({blocks} KV blocks) but the pool has "
                             f"{self.block_manager.num_blocks} blocks; raise num_kv_blocks or lower max_tokens")
        if request_id is None:
            request_id = str(next(self._ids))
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_source))
        return Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer), eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.perf_counter()),
        )

    def add(self, request: Request) -> str:
        """Queue a request made by :meth:`make_request`; returns its id."""
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Check, encode and queue one prompt; returns the request id to follow it by."""
        return self.add(self.make_request(prompt, params or SamplingParams(), request_id=request_id))

    def watch(self, request_id: str) -> deque[StreamDelta]:
        """Keep every future delta of ``request_id`` in a queue, so several streams can share the engine."""
        return self.outboxes.setdefault(request_id, deque())

    def unwatch(self, request_id: str) -> None:
        """Stop keeping deltas for ``request_id``."""
        self.outboxes.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finish_reason is not None:
            return False
        request.abort(time.perf_counter())
        self.scheduler.finish(request)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Run one scheduling step; return a delta for every request that got a token."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                # Requests are checked to fit the pool on arrival, so this is a bug, not a load condition.
                raise RuntimeError("the scheduler could not schedule any of the waiting requests")
            return []
        num_prefill = num_decode = 0
        for request, n in batch.entries:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = start
            if request.is_decode(n):
                num_decode += 1
            else:
                num_prefill += n
                request.metrics.prefill_tokens += n
        sampled, tokens = self.runner.execute(batch)
        for request, n in batch.entries:
            request.num_computed_tokens += n
        now = time.perf_counter()
        deltas = []
        for request, token in zip(sampled, tokens, strict=True):
            text = request.append_token(token, now)
            if request.finish_reason is not None:
                self.scheduler.finish(request)
                self.requests.pop(request.request_id, None)
            delta = StreamDelta(request.request_id, token, text, request.finish_reason, request.to_output)
            deltas.append(delta)
            if request.request_id in self.outboxes:
                self.outboxes[request.request_id].append(delta)
        bm = self.block_manager
        self.step_stats.append(StepStats(
            start_time=start, duration=now - start, num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
            prefix_hit_rate=bm.stats.hit_rate, num_preemptions=len(batch.preempted)))
        return deltas
