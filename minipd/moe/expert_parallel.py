"""Expert parallelism: each rank owns a slice of every MoE layer's experts; tokens travel to them.

With ``N`` ranks and ``E`` experts, rank ``r`` owns experts ``[r*E/N, (r+1)*E/N)`` of every layer. A rank
holding tokens routes them, then one MoE layer is three collectives over the group:

1. **header** — an all-to-all of small integer vectors: to each rank, how many rows of each of its
   experts are coming (per micro-batch), which layer, and in which wire format. Every rank learns
   what it will receive before any row moves, so receive buffers have the right size.
2. **dispatch** — an all-to-all of the rows themselves (sorted by expert, so each destination's
   rows are one contiguous slice), optionally as int8/fp8 codes with a scale per row.
3. **combine** — the reverse all-to-all: each expert's outputs go home, where the usual weighted sum
   over the token's ``top_k`` answers (:class:`~minipd.moe.dispatch.LocalDispatcher`) finishes the layer.

With two micro-batches the three steps are pipelined (DeepSeek-V3's dual micro-batch idea, within a
layer): micro-batch 1's rows are in flight while micro-batch 0's experts compute, and micro-batch 0's
answers travel back while micro-batch 1 computes. :class:`CommStats` records how long the rank sat
waiting on the network, which is what the overlap hides.

The collectives run on a process group of their own (no global ``torch.distributed`` state), gloo for
CPU tensors and NCCL for CUDA ones. A rank that dies or stalls turns into :class:`ExpertParallelError`
(after ``timeout`` at most), never a silent wrong answer.
"""

from __future__ import annotations

import datetime
import itertools
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minipd.kv.quant import FORMATS
from minipd.moe.dispatch import Dispatcher, LocalDispatcher, LocalExpertBatch
from minipd.moe.experts import StackedExperts

#: Header ops: what a rank tells every other one before a layer's rows move.
IDLE, FORWARD, SHUTDOWN = 0, 1, -1
#: Wire formats of dispatched rows, by header code (0: the model's dtype, as computed).
WIRE_FORMATS: tuple[str | None, ...] = (None, "int8", "fp8")
#: Most micro-batches one layer call may use (sizes every header).
MAX_MICRO_BATCHES = 2
#: How long a rank waits for the next layer call to start: effectively for ever (rank 0 may sit idle
#: between requests; a vanished rank 0 is noticed from its closed connection, not from this).
IDLE_TIMEOUT = datetime.timedelta(days=7)
#: Header fields before the per-(micro-batch, expert) row counts: op, layer, wire format, micro-batches.
_HEADER_FIELDS = 4


class ExpertParallelError(RuntimeError):
    """An expert-parallel rank died, stalled past the timeout, or the ranks disagree: the model cannot run."""


@dataclass
class CommStats:
    """What one rank's MoE layers did over the network since the last :meth:`reset`.

    Bytes are payload bytes between this rank and the others, each way; rows a rank sends to itself
    never leave the process and are not counted. On the rank holding the tokens, ``dispatch_sent`` is
    its rows going out and ``combine_received`` the answers coming back.
    """

    calls: int = 0
    dispatch_sent: int = 0
    dispatch_received: int = 0
    combine_sent: int = 0
    combine_received: int = 0
    header_bytes: int = 0
    #: (token, expert) rows this rank sent to experts on other ranks.
    rows_sent: int = 0
    #: Seconds blocked waiting for a dispatch or combine to finish (the communication not hidden).
    wait_seconds: float = 0.0
    #: Seconds spent running this rank's experts on rows it received.
    expert_seconds: float = 0.0
    #: Dispatched bytes this rank sent to each other rank, and combined bytes it got back from each.
    dispatch_sent_to: dict[int, int] = field(default_factory=dict)
    combine_received_from: dict[int, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Zero every counter."""
        fresh = CommStats()
        for name in vars(fresh):
            setattr(self, name, getattr(fresh, name))


class ExpertParallelGroup:
    """The ranks sharing every MoE layer's experts, and the collectives between them.

    Args:
        rank: this process's rank (0 is the engine's, which holds the requests).
        world_size: number of ranks; must divide ``num_experts``.
        num_experts: experts per MoE layer.
        process_group: a ``torch.distributed`` process group of ``world_size`` ranks (see :meth:`connect`).
        device: where the exchanged tensors live (CPU for gloo, the rank's GPU for NCCL).
        timeout: seconds any collective of a started layer call may take before the group gives up.
        micro_batches: how many pieces a rank cuts its tokens into per layer call (1 or 2).
        overlap: start every piece's dispatch at once and each combine as soon as its experts are done,
            so one piece's communication runs under the other's compute (False: each collective is
            waited for as soon as it starts; the baseline the overlap is measured against).
    """

    def __init__(self, rank: int, world_size: int, num_experts: int, process_group: Any,
                 device: torch.device | str = "cpu", timeout: float = 60.0, micro_batches: int = 2,
                 overlap: bool = True) -> None:
        if num_experts % world_size:
            raise ValueError(f"expert_parallel_size must divide the number of experts ({num_experts}), "
                             f"got {world_size}")
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches!r}")
        self.rank, self.world_size, self.num_experts = rank, world_size, num_experts
        self.experts_per_rank = num_experts // world_size
        self.process_group = process_group
        self.device = torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.micro_batches = micro_batches
        self.overlap = overlap
        self.stats = CommStats()
        #: When a list, each layer call appends its timeline: ``(what, start, end)`` in ``perf_counter``
        #: seconds, ``what`` one of ``dispatch m``, ``experts m``, ``combine m``. A transfer's end is when
        #: this rank learned it was done (its wait returned), an upper bound on when it really finished.
        self.trace: list[list[tuple[str, float, float]]] | None = None
        self.broken: str | None = None

    @classmethod
    def connect(cls, rank: int, world_size: int, num_experts: int, store: Any, timeout: float = 60.0,
                device: torch.device | str = "cpu", micro_batches: int = 2) -> ExpertParallelGroup:
        """Join the group through a ``torch.distributed`` store (blocks until all ranks have joined)."""
        device = torch.device(device)
        prefix = dist.PrefixStore("minipd-ep", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = IDLE_TIMEOUT
            group: Any = dist.ProcessGroupNCCL(prefix, rank, world_size, options)
        else:
            # Connections between ranks on the loopback interface only: nothing listens beyond this machine.
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = IDLE_TIMEOUT
            group = dist.ProcessGroupGloo(prefix, rank, world_size, options)
        return cls(rank, world_size, num_experts, group, device, timeout, micro_batches)

    # ------------------------------------------------------------------------------ ownership
    def owned(self, rank: int | None = None) -> range:
        """The global expert ids ``rank`` (this one by default) owns."""
        rank = self.rank if rank is None else rank
        return range(rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank)

    @property
    def header_size(self) -> int:
        """Integers sent to each rank in a header."""
        return _HEADER_FIELDS + MAX_MICRO_BATCHES * self.experts_per_rank

    # ----------------------------------------------------------------------------- collectives
    def all_to_all(self, output: torch.Tensor, data: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], idle: bool = False) -> Any:
        """Start an all-to-all of rows (split sizes along dim 0); returns the work to ``wait`` on.

        It must finish within :attr:`timeout`, or with ``idle`` (a rank waiting for the next layer
        call) within :data:`IDLE_TIMEOUT`.
        """
        self._check_usable()
        options = dist.AllToAllOptions()
        options.timeout = IDLE_TIMEOUT if idle else self.timeout
        try:
            return self.process_group.alltoall_base(output, data, output_splits, input_splits, options)
        except RuntimeError as err:
            raise self._fail(err) from err

    def wait(self, work: Any) -> None:
        """Block until ``work`` is done; the time counts as communication not hidden."""
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as err:
            raise self._fail(err) from err
        finally:
            self.stats.wait_seconds += time.perf_counter() - start

    def exchange_headers(self, headers: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Send row ``d`` of ``headers`` (world_size, header_size) to rank ``d``; returns what each rank sent here.

        ``idle``: this rank is waiting for others to start a layer call, which may take any time.
        """
        received = torch.empty_like(headers)
        self.wait(self.all_to_all(received, headers, [1] * self.world_size, [1] * self.world_size, idle))
        self.stats.header_bytes += headers.numel() * headers.element_size()
        return received

    def idle_headers(self, op: int = IDLE) -> torch.Tensor:
        """Headers saying "nothing from me" (or, with ``op=SHUTDOWN``, "stop") to every rank."""
        headers = torch.zeros(self.world_size, self.header_size, dtype=torch.int64, device=self.device)
        headers[:, 0] = op
        return headers

    def shutdown(self) -> None:
        """Tell every other rank to stop serving (called by the rank that holds the requests)."""
        if self.broken is None:
            self.exchange_headers(self.idle_headers(SHUTDOWN))
        self.broken = self.broken or "shut down"

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise ExpertParallelError(f"the expert-parallel group is unusable: {self.broken}")

    def _fail(self, err: Exception) -> ExpertParallelError:
        self.broken = f"a rank stopped answering ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        return ExpertParallelError(f"expert parallelism failed: {self.broken}")


def shard_experts(experts: StackedExperts, group: ExpertParallelGroup) -> None:
    """Keep only this rank's slice of ``experts`` (its weights are copied out, the rest freed)."""
    owned = group.owned()
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data[owned.start:owned.stop].clone(),
                                              requires_grad=False)
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data[owned.start:owned.stop].clone(),
                                           requires_grad=False)
    experts.num_experts = len(owned)


def encode_rows(rows: torch.Tensor, wire_format: str | None) -> torch.Tensor:
    """Rows as they travel: unchanged, or per-row codes followed by the row's fp16 scale, as bytes."""
    if wire_format is None:
        return rows
    codes, scales = FORMATS[wire_format].quantize(rows)
    return torch.cat((codes.view(torch.uint8), scales.unsqueeze(-1).view(torch.uint8)), dim=-1)


def decode_rows(payload: torch.Tensor, wire_format: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: rows of ``dtype``."""
    if wire_format is None:
        return payload.to(dtype)
    fmt = FORMATS[wire_format]
    codes = payload[:, :-2].contiguous().view(fmt.storage)
    scales = payload[:, -2:].contiguous().view(torch.float16).squeeze(-1)
    return fmt.dequantize(codes, scales, dtype)


class ExpertParallelDispatcher(Dispatcher[LocalExpertBatch]):
    """The dispatcher of one MoE layer whose experts are spread over an :class:`ExpertParallelGroup`.

    :meth:`run` is the layer's whole expert stage (header, dispatch, this rank's experts, combine);
    :meth:`serve` is the same stage on a rank with no tokens of its own, called once the header said
    which layer is running. ``dispatch``/``combine`` alone (the base interface) are not meaningful here:
    the rows a rank computes are other ranks' rows.
    """

    def __init__(self, group: ExpertParallelGroup, layer_index: int, num_experts: int) -> None:
        self.group, self.layer_index, self.num_experts = group, layer_index, num_experts
        self.local = LocalDispatcher(num_experts)

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> LocalExpertBatch:
        raise NotImplementedError("an expert-parallel layer runs dispatch, experts and combine together: call run()")

    def combine(self, expert_out: torch.Tensor, batch: LocalExpertBatch) -> torch.Tensor:
        raise NotImplementedError("an expert-parallel layer runs dispatch, experts and combine together: call run()")

    def run(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: StackedExperts,
            row_format: str | None = None) -> torch.Tensor:
        """The routed experts' weighted output (T, hidden) for this rank's tokens ``hidden`` (T, hidden)."""
        group = self.group
        tokens = hidden.shape[0]
        splits = min(group.micro_batches, tokens) if tokens else 1
        bounds = [tokens * m // splits for m in range(splits + 1)]
        payload = encode_rows(hidden, row_format)
        batches = [self.local.dispatch(payload[a:b], weights[a:b], expert_ids[a:b])
                   for a, b in itertools.pairwise(bounds)]
        # Rows per (micro-batch, expert) on the host: the split sizes of the all-to-alls.
        counts = torch.stack([b.counts for b in batches]).cpu()
        headers = group.idle_headers()
        headers[:, 0] = FORWARD
        headers[:, 1] = self.layer_index
        headers[:, 2] = WIRE_FORMATS.index(row_format)
        headers[:, 3] = splits
        per_rank = counts.view(splits, group.world_size, group.experts_per_rank).transpose(0, 1)
        headers[:, _HEADER_FIELDS:_HEADER_FIELDS + splits * group.experts_per_rank] = \
            per_rank.reshape(group.world_size, -1).to(headers.device)
        received = group.exchange_headers(headers)
        sent_rows = [per_rank[:, m].sum(dim=1).tolist() for m in range(splits)]
        outputs = self._exchange(received, [b.hidden for b in batches], sent_rows, experts, hidden.dtype,
                                 hidden.shape[-1])
        return torch.cat([self.local.combine(out, batch) for out, batch in zip(outputs, batches, strict=True)])

    def serve(self, received: torch.Tensor, experts: StackedExperts, dtype: torch.dtype, hidden_size: int) -> None:
        """Take part in a layer call started by other ranks, with no tokens of this rank's own."""
        self._exchange(received, [], [], experts, dtype, hidden_size)

    # ------------------------------------------------------------------------------ internals
    def _exchange(self, received: torch.Tensor, payloads: list[torch.Tensor], sent_rows: list[list[int]],
                  experts: StackedExperts, dtype: torch.dtype, hidden_size: int) -> list[torch.Tensor]:
        """Dispatch every micro-batch, run this rank's experts on what arrives, send the outputs home.

        Returns, per micro-batch this rank sent, the outputs of its rows in the order they were sent.
        """
        group = self.group
        world, local_experts = group.world_size, group.experts_per_rank
        forwarding = received[:, 0] == FORWARD
        layers = received[forwarding, 1].unique().tolist()
        formats = received[forwarding, 2].unique().tolist()
        if len(layers) != 1 or layers[0] != self.layer_index or len(formats) != 1:
            raise ExpertParallelError(f"ranks disagree on the MoE layer being run: layer {self.layer_index} here, "
                                      f"{layers} (wire formats {formats}) from the others")
        wire_format = WIRE_FORMATS[int(formats[0])]
        splits = int(received[:, 3].max())
        # (source rank, micro-batch, local expert) rows arriving here.
        incoming = received[:, _HEADER_FIELDS:].view(world, MAX_MICRO_BATCHES, local_experts)[:, :splits].cpu()
        width = hidden_size if wire_format is None else _wire_width(wire_format, hidden_size)
        wire_dtype = dtype if wire_format is None else torch.uint8
        device = group.device

        def empty(rows: int, cols: int, kind: torch.dtype) -> torch.Tensor:
            return torch.empty(rows, cols, dtype=kind, device=device)

        events: list[tuple[str, float, float]] = []
        stats = group.stats

        def landed(work: Any, what: str, issued: float) -> None:
            group.wait(work)
            events.append((what, issued, time.perf_counter()))

        # 1. every micro-batch's dispatch is started at once; micro-batch m+1 travels while m computes.
        arrivals, dispatches, issued = [], [], []
        for m in range(splits):
            rows_in = incoming[:, m].sum(dim=1).tolist()
            send = payloads[m] if m < len(payloads) else empty(0, width, wire_dtype)
            out_splits = sent_rows[m] if m < len(sent_rows) else [0] * world
            buffer = empty(sum(rows_in), width, wire_dtype)
            issued.append(time.perf_counter())
            dispatches.append(group.all_to_all(buffer, send.contiguous(), rows_in, out_splits))
            arrivals.append((buffer, rows_in, out_splits))
            stats.dispatch_sent += _off_rank_bytes(send, out_splits, group.rank)
            stats.dispatch_received += _off_rank_bytes(buffer, rows_in, group.rank)
            stats.rows_sent += sum(out_splits) - out_splits[group.rank]
            _add_per_rank(stats.dispatch_sent_to, send, out_splits, group.rank)
            if not group.overlap:  # serial: nothing else to do until it lands
                landed(dispatches[m], f"dispatch {m}", issued[m])
        # 2. compute each micro-batch as it lands and start its combine.
        returns, results = [], []
        for m, (buffer, rows_in, out_splits) in enumerate(arrivals):
            if group.overlap:
                landed(dispatches[m], f"dispatch {m}", issued[m])
            start = time.perf_counter()
            answers = self._run_local(decode_rows(buffer, wire_format, dtype), incoming[:, m], experts)
            end = time.perf_counter()
            stats.expert_seconds += end - start
            events.append((f"experts {m}", start, end))
            result = empty(sum(out_splits), hidden_size, answers.dtype)
            returns.append((group.all_to_all(result, answers, out_splits, rows_in), time.perf_counter()))
            results.append(result)
            stats.combine_sent += _off_rank_bytes(answers, rows_in, group.rank)
            stats.combine_received += _off_rank_bytes(result, out_splits, group.rank)
            _add_per_rank(stats.combine_received_from, result, out_splits, group.rank)
            if not group.overlap:
                landed(returns[m][0], f"combine {m}", returns[m][1])
        if group.overlap:
            for m, (work, started) in enumerate(returns):
                landed(work, f"combine {m}", started)
        stats.calls += 1
        if group.trace is not None:
            group.trace.append(events)
        return results[:len(payloads)]

    @staticmethod
    def _run_local(rows: torch.Tensor, incoming: torch.Tensor, experts: StackedExperts) -> torch.Tensor:
        """This rank's experts on rows grouped (source rank, expert); outputs in the same order.

        ``incoming`` (world, local_experts): rows per source and expert. The experts want all rows of
        expert 0, then expert 1, ...: a stable sort by expert makes that order, and its inverse undoes it.
        """
        world, local_experts = incoming.shape
        if rows.shape[0] == 0:
            return rows
        expert_of_row = torch.arange(local_experts).repeat(world).repeat_interleave(incoming.reshape(-1))
        order = expert_of_row.argsort(stable=True).to(rows.device)
        out = experts(rows.index_select(0, order), incoming.sum(dim=0).to(rows.device))
        answers = torch.empty_like(out)
        answers.index_copy_(0, order, out)
        return answers


def _wire_width(wire_format: str, hidden_size: int) -> int:
    """Bytes per dispatched row in ``wire_format``: codes then a 2-byte scale."""
    return hidden_size // FORMATS[wire_format].pack + 2


def _add_per_rank(totals: dict[int, int], data: torch.Tensor, splits: list[int], rank: int) -> None:
    """Add the bytes of ``data`` (rows split by rank) going to (or coming from) each other rank to ``totals``."""
    if data.shape[0] == 0:
        return
    row_bytes = data[0].numel() * data.element_size()
    for other, rows in enumerate(splits):
        if other != rank and rows:
            totals[other] = totals.get(other, 0) + rows * row_bytes


def _off_rank_bytes(data: torch.Tensor, splits: list[int], rank: int) -> int:
    """Bytes of ``data`` (rows split by destination) that go to other ranks."""
    if data.shape[0] == 0:
        return 0
    row_bytes = data[0].numel() * data.element_size()
    return (sum(splits) - splits[rank]) * row_bytes


def loopback_store(world_size: int, timeout: float) -> Any:
    """A ``torch.distributed`` TCP store served on 127.0.0.1 only (the default listens on every interface);
    its port is ``store.port``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # detach(): the store owns the descriptor from now on, so Python never closes it under the store.
    return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=False)


__all__ = [
    "MAX_MICRO_BATCHES",
    "WIRE_FORMATS",
    "CommStats",
    "ExpertParallelDispatcher",
    "ExpertParallelError",
    "ExpertParallelGroup",
    "decode_rows",
    "encode_rows",
    "loopback_store",
    "shard_experts",
]
