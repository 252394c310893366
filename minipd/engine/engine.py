"""The in-process engine: an :class:`~minipd.engine.core.EngineCore` with its front end beside it.

``add_request`` / ``step`` / ``abort`` is the engine-level API that streaming, the chapters and
:class:`~minipd.llm.LLM` build on; it is the shared :class:`~minipd.engine.front_end.FrontEnd`
(prompts checked and tokenised, request ids handed out, the core's token-id outputs turned into
text deltas), here over an :class:`EngineCore` in this process. The same core can instead run
behind queues in a thread or another process (:mod:`minipd.engine.core_client`).
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

import torch

from minipd.engine.config import EngineConfig
from minipd.engine.core import CPU_KV_MEMORY, EngineCore
from minipd.engine.front_end import FrontEnd
from minipd.engine.scheduler import Scheduler
from minipd.engine.stats import StepStats
from minipd.kv.block_manager import BlockManager
from minipd.kv.paged_pool import PackedKV, PagedKVPool
from minipd.models.decoder import DecoderModel
from minipd.outputs import StreamDelta
from minipd.tokenizer import Tokenizer

__all__ = ["CPU_KV_MEMORY", "Engine"]


class Engine(FrontEnd):
    """A continuous-batching engine over a paged KV cache for one model, with text in and out.

    The front end (:class:`~minipd.engine.front_end.FrontEnd`) over an :class:`EngineCore` built for
    ``model``; adds the core's parts for the chapters, K/V export and snapshots.
    """

    core: EngineCore

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, max_model_len: int,
                 eos_token_ids: frozenset[int], seed: int | None = None) -> None:
        self._setup(EngineCore(model, config, max_model_len), tokenizer, eos_token_ids, seed)

    @classmethod
    def from_core(cls, core: EngineCore, tokenizer: Tokenizer, eos_token_ids: frozenset[int],
                  seed: int | None = None) -> Engine:
        """The engine over a core built already (see :func:`minipd.engine.factory.build_core`)."""
        engine = cls.__new__(cls)
        engine._setup(core, tokenizer, eos_token_ids, seed)
        return engine

    def _setup(self, core: EngineCore, tokenizer: Tokenizer, eos_token_ids: frozenset[int], seed: int | None) -> None:
        config = core.config
        FrontEnd.__init__(self, core, tokenizer, core.max_model_len, eos_token_ids, core.model.config.vocab_size, seed)
        self.model = core.model  # the engine's own view of the model (see EngineCore)
        self.config = config
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

        As :meth:`FrontEnd.step <minipd.engine.front_end.FrontEnd.step>` (a failure is raised only once the
        step's tokens are delivered); then, every ``snapshot_interval`` steps, a snapshot is saved.
        """
        before = self.core.num_steps
        deltas = super().step()
        interval = self.config.snapshot_interval
        if interval and self.core.num_steps != before and self.core.num_steps % interval == 0:
            self.save_snapshot(self.config.snapshot_path)  # type: ignore[arg-type]
        return deltas
