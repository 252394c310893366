"""The public entry point, in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

``LLM`` loads the model and tokenizer and drives an :class:`~minipd.engine.engine.Engine`:
a paged KV cache with prefix caching, and a continuous-batching scheduler with chunked prefill.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from minipd.config import ModelConfig
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.engine.factory import build_core
from minipd.engine.front_end import eos_token_ids
from minipd.engine.inputs import check_llm_args
from minipd.llm_base import LLMBase
from minipd.tokenizer import Tokenizer

if TYPE_CHECKING:
    from minipd.engine.expert_ranks import ExpertParallelRanks

logger = logging.getLogger("minipd")


class LLM(LLMBase):
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
            ``stats_history``…, flat or by group (``cache={"block_size": 32}``); ``expert_parallel_size=N``
            spreads a mixture-of-experts model's experts over N processes (call :meth:`close`, or use the
            ``LLM`` as a context manager, to stop them early). ``repr(llm)`` says what the engine runs with.
    """

    def __init__(self, model: str | os.PathLike = "tiny-py", *, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None, max_model_len: int | None = None, seed: int | None = None,
                 **engine_options: object) -> None:
        engine_config = EngineConfig.from_options(engine_options)
        _, seed = check_llm_args(max_model_len, seed)  # before loading: bad values cost nothing
        built = build_core(model, device=device, dtype=dtype, max_model_len=max_model_len,
                           engine_config=engine_config)
        self.model_path = built.model_path
        self.config: ModelConfig = built.model.config
        self.tokenizer = Tokenizer(self.model_path)
        self.max_model_len = built.core.max_model_len
        #: The other processes holding this model's experts (``expert_parallel_size > 1``), else None.
        self.expert_parallel: ExpertParallelRanks | None = built.expert_parallel
        if self.expert_parallel is not None:
            # Stop the ranks when this LLM is collected or the interpreter exits, if close() was not called.
            self._finalizer = weakref.finalize(self, self.expert_parallel.close)
        eos = eos_token_ids(built.model.config, self.tokenizer)
        self.engine = Engine.from_core(built.core, self.tokenizer, eos, seed)
        #: The model as this LLM's engine runs it (its own view of the loaded weights: packed or quantized
        #: linears, MoE settings); swap a part here and generate() uses it.
        self.model = self.engine.core.model
        # One lock around the engine: threads submit and step in turn, never at once.
        self._lock = threading.RLock()
        logger.info("KV pool: %d blocks of %d tokens = %d tokens (%.1f MiB)", self.engine.pool.num_blocks,
                    engine_config.block_size, self.kv_capacity_tokens, self.engine.pool.nbytes / 2**20)

    def close(self) -> None:
        """Stop the processes this LLM started (expert-parallel ranks) and any background compilation of decode
        programs (the one in progress finishes on its own); a no-op otherwise. Idempotent."""
        compiled = self.engine.core.runner.compiled
        if compiled is not None:
            compiled.stop_compiling(timeout=0)
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

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, so that the next prompts are computed in full (vLLM's call of the same name).

        Returns False, changing nothing, while requests are in progress (their blocks may be shared).
        """
        with self._lock:
            return self.engine.block_manager.reset_prefix_cache()

    def describe(self) -> dict:
        """What this LLM's engine runs with, every "auto" resolved (kernels, linears, KV format, compiled
        decode, ...); also its ``repr``."""
        info = {"model": str(self.model_path.name), **self.engine.core.describe()}
        if self.expert_parallel is not None:
            info["expert_parallel_size"] = self.engine.core.config.expert_parallel_size
        return info

    def __repr__(self) -> str:
        return f"LLM({', '.join(f'{k}={v!r}' for k, v in self.describe().items())})"

