"""Build an engine core from a model name and options, without a front end.

What a process that only serves a core needs — an engine core process
(:meth:`CoreClient.in_process <minipd.engine.core_client.CoreClient.in_process>`), a prefill or decode
worker (:mod:`minipd.pd.worker`) — and what :class:`~minipd.llm.LLM` builds its engine on: the model
loaded, the options checked, expert-parallel ranks started when asked for, and the
:class:`~minipd.engine.core.EngineCore` over it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minipd.engine.config import EngineConfig
from minipd.engine.core import EngineCore
from minipd.engine.inputs import check_llm_args
from minipd.errors import ParameterError
from minipd.models.decoder import DecoderModel
from minipd.models.loading import load_model

if TYPE_CHECKING:
    from minipd.engine.expert_ranks import ExpertParallelRanks


@dataclass
class BuiltCore:
    """An engine core and what came with it."""

    core: EngineCore
    #: The model as loaded (the core runs its own view of it) and the folder it came from.
    model: DecoderModel
    model_path: Path
    #: The processes holding the model's other experts (``expert_parallel_size > 1``), else None.
    expert_parallel: ExpertParallelRanks | None = None

    def close(self) -> None:
        """Stop the expert-parallel ranks, if any (idempotent)."""
        if self.expert_parallel is not None:
            self.expert_parallel.close()


def build_core(model: str | os.PathLike, *, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None, max_model_len: int | None = None, seed: int | None = None,
               engine_config: EngineConfig | None = None, **engine_options: Any) -> BuiltCore:
    """Load ``model`` and build its engine core (``engine_options`` as ``LLM``'s, or an ``engine_config``).

    ``seed`` is checked and otherwise unused (a core's requests carry their own seeds): it is accepted so
    that ``LLM``'s options pass through unchanged."""
    if engine_config is None:
        engine_config = EngineConfig.from_options(engine_options)
    elif engine_options:
        raise ParameterError(next(iter(engine_options)), "pass engine options or an engine_config, not both")
    max_model_len, _ = check_llm_args(max_model_len, seed)  # before loading: bad values cost nothing
    loaded, path = load_model(model, device=device, dtype=dtype)
    context = loaded.config.max_position_embeddings
    if max_model_len is not None and not 1 < max_model_len <= context:
        raise ParameterError("max_model_len",
                             f"max_model_len must be in [2, {context}] for this model, got {max_model_len}")
    ranks = None
    if engine_config.expert_parallel_size > 1:
        from minipd.engine.expert_ranks import start_ranks

        ranks = start_ranks(loaded, path, engine_config.expert_parallel_size, moe_backend=engine_config.moe_backend,
                            timeout=engine_config.expert_parallel_timeout,
                            micro_batches=2 if engine_config.expert_parallel_overlap else 1)
        ranks.group.overlap = engine_config.expert_parallel_overlap
    try:
        core = EngineCore(loaded, engine_config, max_model_len or context)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    return BuiltCore(core, loaded, path, ranks)


__all__ = ["BuiltCore", "build_core"]
