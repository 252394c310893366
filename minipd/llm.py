"""The public entry point, in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

``LLM`` loads the model and tokenizer and drives an :class:`~minipd.engine.engine.Engine`:
a paged KV cache with prefix caching, and a continuous-batching scheduler with chunked prefill.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from minipd.config import ModelConfig
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.engine.inputs import PromptInput, check_llm_args, normalize_params, normalize_prompts
from minipd.errors import ParameterError
from minipd.models.loading import load_model
from minipd.outputs import RequestOutput, RequestStream, StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import Tokenizer

if TYPE_CHECKING:
    from minipd.moe.ranks import ExpertParallelRanks

logger = logging.getLogger("minipd")


class LLM:
    """A model ready to generate: a bundled name (``"tiny-py"``), a local HF folder, or a hub id.

    Args:
        model: what to load; an unknown name raises ``ValueError`` listing the bundled models.
        device: ``"cuda"``, ``"cpu"`` or a ``torch.device``; CUDA when present by default.
        dtype: parameter and activation dtype; bf16 on CUDA and fp32 on CPU by default.
        max_model_len: cap on prompt plus output tokens; the model's context length by default.
        seed: seeds the random source of requests that give no ``SamplingParams.seed``.
        **engine_options: :class:`~minipd.engine.config.EngineConfig` fields — ``block_size``,
            ``num_kv_blocks``, ``kv_cache_memory``, ``max_num_batched_tokens``, ``max_num_seqs``,
            ``enable_prefix_caching``, ``scheduling_policy``, ``kernel_backend``, ``kv_cache_dtype``,
            ``stats_history``; ``expert_parallel_size=N`` spreads a mixture-of-experts model's experts over N
            processes (call :meth:`close`, or use the ``LLM`` as a context manager, to stop them early).
    """

    def __init__(self, model: str | os.PathLike = "tiny-py", *, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None, max_model_len: int | None = None, seed: int | None = None,
                 **engine_options: object) -> None:
        engine_config = EngineConfig.from_options(engine_options)
        max_model_len, seed = check_llm_args(max_model_len, seed)  # before loading: bad values cost nothing
        self.model, self.model_path = load_model(model, device=device, dtype=dtype)
        self.config: ModelConfig = self.model.config
        self.tokenizer = Tokenizer(self.model_path)
        context = self.config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= context:
            raise ParameterError("max_model_len",
                                 f"max_model_len must be in [2, {context}] for this model, got {max_model_len}")
        self.max_model_len = max_model_len or context
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        #: The other processes holding this model's experts (``expert_parallel_size > 1``), else None.
        self.expert_parallel: ExpertParallelRanks | None = None
        if engine_config.expert_parallel_size > 1:
            from minipd.moe.ranks import start_ranks

            self.expert_parallel = start_ranks(
                self.model, self.model_path, engine_config.expert_parallel_size, moe_backend=engine_config.moe_backend,
                timeout=engine_config.expert_parallel_timeout,
                micro_batches=2 if engine_config.expert_parallel_overlap else 1)
            self.expert_parallel.group.overlap = engine_config.expert_parallel_overlap
            # Stop the ranks when this LLM is collected or the interpreter exits, if close() was not called.
            self._finalizer = weakref.finalize(self, self.expert_parallel.close)
        self.engine = Engine(self.model, self.tokenizer, engine_config, self.max_model_len, frozenset(eos), seed)
        #: The model as this LLM's engine runs it (its own view of the loaded weights: packed or quantized
        #: linears, MoE settings); swap a part here and generate() uses it.
        self.model = self.engine.core.model
        # One lock around the engine: threads submit and step in turn, never at once.
        self._lock = threading.RLock()
        logger.info("KV pool: %d blocks of %d tokens = %d tokens (%.1f MiB)", self.engine.pool.num_blocks,
                    engine_config.block_size, self.kv_capacity_tokens, self.engine.pool.nbytes / 2**20)

    def close(self) -> None:
        """Stop the processes this LLM started (expert-parallel ranks); a no-op otherwise. Idempotent."""
        if self.expert_parallel is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and activations."""
        return self.engine.dtype

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens of K/V fit in the pool, across all requests."""
        return self.engine.kv_capacity_tokens

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes one token of K/V takes in the pool, every layer, scales included (a KIVI cache's
        residual window is a fixed cost on top, see ``PagedKVPool.residual_bytes``)."""
        return self.engine.core.kv_spec.bytes_per_token

    def describe(self) -> dict:
        """What this LLM's engine runs with, every "auto" resolved (kernels, linears, KV format, compiled
        decode, ...); also its ``repr``."""
        info = {"model": str(self.model_path.name), **self.engine.core.describe()}
        if self.expert_parallel is not None:
            info["expert_parallel_size"] = self.engine.core.config.expert_parallel_size
        return info

    def __repr__(self) -> str:
        return f"LLM({', '.join(f'{k}={v!r}' for k, v in self.describe().items())})"

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

    def __init__(self, llm: LLM, outbox: deque[StreamDelta]) -> None:
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
