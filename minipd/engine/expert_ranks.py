"""Starting, running and stopping the expert-parallel ranks of an ``LLM(..., expert_parallel_size=N)``.

Rank 0 is the engine's own process: it keeps the requests, the KV cache, attention and the routers,
and its share of every layer's experts. Ranks 1..N-1 are subprocesses that load the same
checkpoint, keep only their slice of each MoE layer's experts, and serve: each waits for a header
(:mod:`minipd.moe.expert_parallel`), runs the named layer's experts on the rows that arrive and sends
the outputs back, until rank 0 says stop. They hold no tokens of their own, so their whole job is
the expert stage; the all-to-alls are nevertheless symmetric, and a rank with requests of its own
(data-parallel attention) would send and receive in the same calls.

Lifetimes are bounded: a rank that dies is seen by rank 0's next collective (gloo reports the closed
connection), a rank that stalls by the timeout; either makes the model unusable with
:class:`~minipd.moe.expert_parallel.ExpertParallelError`. Serving ranks exit when rank 0 goes away.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minipd.layers.moe import MoE
from minipd.moe.expert_parallel import (
    FORWARD,
    SHUTDOWN,
    ExpertParallelDispatcher,
    ExpertParallelError,
    ExpertParallelGroup,
    loopback_store,
    shard_experts,
)


def moe_layers_of(model: torch.nn.Module) -> list[MoE]:
    """The model's MoE layers, in the order a forward runs them."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class RankProcess:
    """A spawned rank: ``python -m minipd.engine.expert_ranks SETTINGS``, with the bits of the
    ``multiprocessing.Process`` interface this module and its tests use."""

    def __init__(self, rank: int, settings: dict[str, Any]) -> None:
        self.rank = rank
        self._popen = subprocess.Popen([sys.executable, "-m", "minipd.engine.expert_ranks", json.dumps(settings)],
                                       stdin=subprocess.DEVNULL)
        self.pid = self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status once it has exited, else None."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        """Whether it is still running."""
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for it to exit."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=timeout)

    def kill(self) -> None:
        """Kill it if it still runs, and reap it."""
        if self.is_alive():
            self._popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=10)


class ExpertParallelRanks:
    """Rank 0's handle on the group: the communication stats, and :meth:`close` to stop the other ranks."""

    def __init__(self, group: ExpertParallelGroup, processes: list[Any], store: Any) -> None:
        self.group, self.processes, self._store = group, processes, store

    @property
    def size(self) -> int:
        """Ranks in the group, this one included."""
        return self.group.world_size

    @property
    def stats(self) -> Any:
        """This rank's :class:`~minipd.moe.expert_parallel.CommStats` (``.reset()`` to start a measurement)."""
        return self.group.stats

    def alive(self) -> list[bool]:
        """Whether each spawned rank (1..N-1) is still running."""
        return [p.is_alive() for p in self.processes]

    def close(self, timeout: float = 10.0) -> None:
        """Tell the ranks to stop, wait up to ``timeout`` s for them, then kill what is left. Idempotent."""
        if self.group.broken is None and all(self.alive()):
            with contextlib.suppress(ExpertParallelError, RuntimeError):
                self.group.shutdown()
        self.group.broken = self.group.broken or "closed"
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            process.kill()


def start_ranks(model: torch.nn.Module, model_path: str | Path, size: int, *, moe_backend: str = "auto",
                timeout: float = 60.0, start_timeout: float = 180.0, micro_batches: int = 2,
                threads: int | None = None) -> ExpertParallelRanks:
    """Spawn ranks 1..``size``-1 for ``model`` (loaded from ``model_path``), shard its experts, wire its layers.

    After this, ``model``'s MoE layers run their experts across the group: rank 0 keeps experts
    ``[0, E/size)`` and every layer's dispatcher is an
    :class:`~minipd.moe.expert_parallel.ExpertParallelDispatcher`. ``timeout`` bounds every collective once
    a layer call has started; ``start_timeout`` bounds loading and joining. The ranks are
    ``python -m minipd.engine.expert_ranks`` subprocesses, which load ``model_path`` themselves.
    """
    layers = moe_layers_of(model)
    if not layers:
        raise ValueError(f"expert_parallel_size={size} needs a mixture-of-experts model; this one has no MoE layer")
    num_experts = layers[0].router.num_experts
    if num_experts % size:
        raise ValueError(f"expert_parallel_size must divide the number of experts ({num_experts}), got {size}")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"expert_parallel_size={size} on CUDA needs {size} GPUs, found {torch.cuda.device_count()}")
    store = loopback_store(size, start_timeout)
    threads = threads or torch.get_num_threads()
    # Plain subprocesses, not multiprocessing: a PD worker is a daemonic process, and those may not
    # have multiprocessing children; and nothing of the caller's script is re-imported.
    processes = []
    for rank in range(1, size):
        settings = dict(model_path=str(model_path), dtype=str(dtype).removeprefix("torch."), rank=rank, size=size,
                        port=store.port, timeout=timeout, start_timeout=start_timeout, moe_backend=moe_backend,
                        threads=threads, device=f"cuda:{rank}" if device.type == "cuda" else "cpu",
                        micro_batches=micro_batches)
        processes.append(RankProcess(rank, settings))
    ranks = None
    try:
        group = _join(processes, size, num_experts, store, timeout, start_timeout, device, micro_batches)
        ranks = ExpertParallelRanks(group, processes, store)
        for index, layer in enumerate(layers):
            shard_experts(layer.experts, group)
            layer.dispatcher = ExpertParallelDispatcher(group, index, num_experts)
        return ranks
    except BaseException:
        for process in processes:
            process.kill()
        raise


def _join(processes: list[Any], size: int, num_experts: int, store: Any, timeout: float, start_timeout: float,
          device: torch.device, micro_batches: int) -> ExpertParallelGroup:
    """Rank 0 joins the group in a thread, so that a rank dying while loading is reported at once."""
    result: dict[str, Any] = {}

    def connect() -> None:
        try:
            result["group"] = ExpertParallelGroup.connect(0, size, num_experts, store, timeout, device,
                                                          micro_batches)
        except BaseException as err:  # reported by the caller
            result["error"] = err

    thread = threading.Thread(target=connect, name="minipd-ep-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while thread.is_alive():
        thread.join(timeout=0.1)
        for rank, process in enumerate(processes, start=1):
            if not process.is_alive():
                raise ExpertParallelError(f"expert-parallel rank {rank} exited while starting "
                                          f"(exit code {process.exitcode}); see its error above")
        if time.monotonic() > deadline:
            raise ExpertParallelError(f"the expert-parallel ranks did not all start within {start_timeout:.0f} s")
    if "error" in result:
        raise ExpertParallelError(f"joining the expert-parallel group failed: {result['error']}") from result["error"]
    return result["group"]


def serve_rank(model_path: str, dtype: str, rank: int, size: int, port: int, timeout: float, start_timeout: float,
               moe_backend: str, threads: int, device: str, micro_batches: int) -> None:
    """Entry point of a spawned rank: load, keep this rank's experts, serve layer calls until told to stop."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL runs on the current device: this rank's own GPU
    try:
        from minipd.models import load_model

        model, _ = load_model(model_path, device=device, dtype=dtype)
        layers = moe_layers_of(model)
        hidden_size, model_dtype = model.config.hidden_size, next(model.parameters()).dtype
        del model  # attention, embeddings, routers: rank 0's business; only the layers' experts stay
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=start_timeout))
        group = ExpertParallelGroup.connect(rank, size, layers[0].router.num_experts, store, timeout, device,
                                            micro_batches)
        experts, dispatchers = [], []
        for index, layer in enumerate(layers):
            shard_experts(layer.experts, group)
            layer.experts.implementation = moe_backend if moe_backend != "triton" else "auto"  # type: ignore[assignment]
            experts.append(layer.experts)
            dispatchers.append(ExpertParallelDispatcher(group, index, layer.router.num_experts))
        del layers
        while True:
            received = group.exchange_headers(group.idle_headers(), idle=True)
            ops = received[:, 0]
            if bool((ops == SHUTDOWN).any()):
                return
            forwarding = ops == FORWARD
            if not bool(forwarding.any()):
                continue
            index = int(received[forwarding, 1][0])
            if not 0 <= index < len(dispatchers):
                raise ExpertParallelError(f"rank {rank} was asked for MoE layer {index}; it has {len(dispatchers)}")
            dispatchers[index].serve(received, experts[index], model_dtype, hidden_size)
    except ExpertParallelError:
        return  # rank 0 is gone or gave up: nobody left to serve
    except KeyboardInterrupt:
        return
    except BaseException as err:
        print(f"minipd expert-parallel rank {rank} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from err


if __name__ == "__main__":
    serve_rank(**json.loads(sys.argv[1]))
