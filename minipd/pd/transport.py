"""Moving KV blocks between workers' pools: the data plane of prefill/decode disaggregation.

A transport registers a worker's paged pool once and then moves *blocks*: the decode worker reads
(``"pull"``) the blocks a finished prefill holds, straight from the prefill worker's memory into its
own freshly allocated blocks, and the prefill worker is notified when the read is done so it can
free them; or the prefill worker writes (``"push"``, ``"layerwise"``) into blocks the decode worker
reserved. Only the request's blocks move, one descriptor per (layer, K or V, block).

:class:`NixlTransport` uses NIXL (the transfer library behind vLLM's NixlConnector and NVIDIA
Dynamo); with its UCX backend it moves registered CPU memory between processes, and GPU memory over
NVLink or RDMA where the hardware has them. NIXL is Linux-only: ``pip install nixl-cu12``.
:class:`TorchDistributedTransport` does the same with ``torch.distributed`` messages (gloo on CPU)
where NIXL is missing. What the blocks look like to them (layouts, wire formats): :mod:`minipd.pd.kv_layout`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from minipd.kv.paged_pool import PagedKVPool
from minipd.pd.kv_layout import (
    PoolLayout,
    QuantizedWire,
    RawBlocks,
    pool_tensors,
)


def nixl_available() -> str | None:
    """None when NIXL can be used here, else why not (in words)."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as err:
        return f"NIXL is not installed ({err}); pip install nixl-cu12 (Linux only)"
    return None


class NixlTransport:
    """One NIXL agent per worker, its pool registered once; reads peers' blocks and reports finished reads."""

    name = "nixl"

    def __init__(self, agent_name: str, pool: PagedKVPool) -> None:
        problem = nixl_available()
        if problem is not None:
            raise RuntimeError(f"kv transport 'nixl' unavailable: {problem}")
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent_name = agent_name
        # No progress thread: it polls without pause and takes a whole core from the worker's compute;
        # transfers progress whenever this worker checks on them, which its loop does every millisecond.
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False))
        self.layout = PoolLayout.of(pool)
        self._registered = self.agent.register_memory(pool_tensors(pool))
        self._peers: dict[str, PoolLayout] = {}

    def peer_info(self) -> dict[str, Any]:
        """What a peer needs to read from this worker (picklable)."""
        return {"name": self.agent_name, "metadata": self.agent.get_agent_metadata(), "layout": self.layout}

    def add_peer(self, info: dict[str, Any]) -> None:
        """Learn how to reach another worker's pool."""
        self.agent.add_remote_agent(info["metadata"])
        self._peers[info["name"]] = info["layout"]

    def start_read(self, peer: str, remote_blocks: list[int], local_blocks: list[int], notification: bytes) -> Any:
        """Start copying ``remote_blocks`` of ``peer``'s pool into ``local_blocks`` of ours; returns a handle.

        ``peer`` receives ``notification`` once the read is complete.
        """
        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"{len(remote_blocks)} blocks to read into {len(local_blocks)}")
        layout = self._peers[peer]
        if layout.block_bytes != self.layout.block_bytes or layout.num_layers != self.layout.num_layers:
            raise ValueError(f"peer {peer!r} stores blocks of another shape")
        local = self.agent.get_xfer_descs(self.layout.descriptors(local_blocks), self.layout.mem_type)
        remote = self.agent.get_xfer_descs(layout.descriptors(remote_blocks), layout.mem_type)
        handle = self.agent.initialize_xfer("READ", local, remote, peer, notification)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL could not start reading {len(remote_blocks)} blocks from {peer!r}")
        return handle

    def start_write(self, peer: str, local_blocks: list[int], remote_blocks: list[int],
                    layers: list[int] | None = None) -> Any:
        """Start copying our ``local_blocks`` (of ``layers``, all by default) into ``peer``'s ``remote_blocks``."""
        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"{len(local_blocks)} blocks to write into {len(remote_blocks)}")
        layout = self._peers[peer]
        local = self.agent.get_xfer_descs(self.layout.descriptors(local_blocks, layers), self.layout.mem_type)
        remote = self.agent.get_xfer_descs(layout.descriptors(remote_blocks, layers), layout.mem_type)
        handle = self.agent.initialize_xfer("WRITE", local, remote, peer, b"")
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL could not start writing {len(local_blocks)} blocks to {peer!r}")
        return handle

    def poll(self, handle: Any) -> str:
        """``"DONE"``, ``"PROC"`` (in progress) or ``"ERR"`` (also when the peer is gone); a finished handle
        is released."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception:  # NIXL raises when the remote agent disconnected: the transfer is lost
            state = "ERR"
        if state in ("DONE", "ERR"):
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)
        return state

    def notify(self, peer: str, message: bytes) -> None:
        """Send ``peer`` a notification without moving data (e.g. "I will not read these blocks after all")."""
        self.agent.send_notif(peer, message)

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call (one per finished read of our blocks)."""
        try:
            received = self.agent.get_new_notifs()
        except Exception:  # a disconnected peer: its reads are over; the leases free what it held
            return []
        return [msg for messages in received.values() for msg in messages]


class TorchDistributedTransport:
    """The same reads and writes over ``torch.distributed`` point-to-point messages (gloo on CPU), for
    where NIXL is missing.

    torch.distributed cannot touch another process's memory, so every transfer is a conversation with
    the owner of the far pool. A read sends the owner a small header (which blocks, a notification to
    deliver); the owner packs those blocks and sends them back, and the reader writes them into its
    own blocks. A write sends a header (which blocks, which layers) followed by the packed blocks; the
    owner writes them into its pool and acknowledges, and only then is the write done, so "done" means
    what it means for NIXL: the bytes are in the far pool. gloo's sends and receives complete only
    inside a blocking ``wait``, so each worker waits in background threads: one serving headers from
    any rank, one per transfer under way. Every worker joins one process group at start-up. A peer
    that dies breaks the transfers under way; they run into their lease and the requests are
    recomputed.
    """

    name = "torch"
    #: Header: tag, sender rank, block count, notification length, kind, first layer, layer count, then
    #: 64 bytes of notification and the block ids.
    _FIELDS = 7
    _NOTE = 8
    _READ, _WRITE = 0, 1

    def __init__(self, agent_name: str, pool: PagedKVPool, rank: int, world_size: int, address: str,
                 max_blocks_per_request: int, wire_dtype: str | None = None, host: str = "127.0.0.1",
                 store_hosted: bool = False) -> None:
        import datetime
        import threading

        import torch.distributed as dist

        # A process group of our own (not torch's global one), whose store and gloo connections listen
        # on ``host`` only: 127.0.0.1 unless the workers were launched on several machines.
        timeout = datetime.timedelta(seconds=120)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        self.store = rendezvous_store(address, rank, world_size, timeout, hosted=store_hosted)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("minipd-kv", self.store), rank, world_size, options)
        self.agent_name, self.rank, self.pool = agent_name, rank, pool
        #: How blocks are put on the wire: as stored, or quantized for the wire only (``kv_transfer_dtype``).
        self.codec: RawBlocks | QuantizedWire = RawBlocks(pool) if wire_dtype is None else QuantizedWire(pool,
                                                                                                       wire_dtype)
        self.bytes_per_block = self.codec.bytes_per_block
        self.num_layers = pool.k.shape[0]
        self.max_blocks = max_blocks_per_request
        self._peers: dict[str, int] = {}
        self._next_tag = 1
        self._notes: list[bytes] = []
        self._lock = threading.Lock()
        #: Seconds each incoming write waits before it is stored (a fault for tests: writes that land late).
        self.store_delay_s = 0.0
        threading.Thread(target=self._serve, name=f"{agent_name}-kv-server", daemon=True).start()

    def _header_size(self) -> int:
        return self._FIELDS + self._NOTE + self.max_blocks

    def peer_info(self) -> dict[str, Any]:
        """What a peer needs: this worker's rank in the group."""
        return {"name": self.agent_name, "rank": self.rank}

    def add_peer(self, info: dict[str, Any]) -> None:
        """Learn another worker's rank."""
        self._peers[info["name"]] = info["rank"]

    def _header(self, kind: int, blocks: list[int], note: bytes = b"",
                layers: tuple[int, int] | None = None) -> tuple[int, Any]:

        if len(blocks) > self.max_blocks:
            raise ValueError(f"cannot move {len(blocks)} blocks in one transfer (at most {self.max_blocks})")
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        first, count = layers if layers is not None else (0, self.num_layers)
        header = torch.zeros(self._header_size(), dtype=torch.int64)
        header[:self._FIELDS] = torch.tensor([tag, self.rank, len(blocks), len(note), kind, first, count])
        header[self._FIELDS:self._FIELDS + self._NOTE] = torch.frombuffer(
            bytearray(note.ljust(self._NOTE * 8, b"\0")), dtype=torch.int64)
        offset = self._FIELDS + self._NOTE
        header[offset:offset + len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        return tag, header

    def _wait_in_background(self, handle: dict[str, Any], works: list[Any], done_state: str) -> None:
        import threading

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
                handle["state"] = done_state
            except RuntimeError:
                handle["state"] = "ERR"

        threading.Thread(target=wait, name=f"{self.agent_name}-kv-transfer", daemon=True).start()

    def start_read(self, peer: str, remote_blocks: list[int], local_blocks: list[int], notification: bytes) -> Any:
        """Ask ``peer`` for ``remote_blocks``; they land in ``local_blocks`` when :meth:`poll` says DONE."""

        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"cannot read {len(remote_blocks)} blocks into {len(local_blocks)}")
        tag, header = self._header(self._READ, remote_blocks, notification[:self._NOTE * 8])
        src = self._peers[peer]
        handle: dict[str, Any] = {"state": "PROC", "blocks": list(local_blocks)}
        works = []
        if remote_blocks:
            # The receive is posted before the header leaves, so the reply always has somewhere to land.
            handle["buffer"] = torch.empty(self.codec.size(self.num_layers, len(remote_blocks)), dtype=torch.uint8)
            works.append(self.group.recv([handle["buffer"]], src, tag))
        works.insert(0, self.group.send([header], src, 0))
        self._wait_in_background(handle, works, "RECEIVED")
        return handle

    def start_write(self, peer: str, local_blocks: list[int], remote_blocks: list[int],
                    layers: list[int] | None = None) -> Any:
        """Send our ``local_blocks`` (of ``layers``, a contiguous run, all by default) into ``peer``'s
        ``remote_blocks``; :meth:`poll` says DONE once the peer has stored them."""

        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"{len(local_blocks)} blocks to write into {len(remote_blocks)}")
        first, count = (0, self.num_layers) if layers is None else (min(layers), len(layers))
        if layers is not None and sorted(layers) != list(range(first, first + count)):
            raise ValueError(f"layers must be a contiguous run, got {layers}")
        tag, header = self._header(self._WRITE, remote_blocks, layers=(first, count))
        dst = self._peers[peer]
        index = torch.tensor(local_blocks, dtype=torch.long)
        # Packed now, so the bytes sent are this moment's even if the pool changes while they travel.
        packed = self.codec.pack(slice(first, first + count), index)
        handle: dict[str, Any] = {"state": "PROC", "blocks": [], "packed": packed}
        acknowledgement = torch.zeros(1, dtype=torch.int64)
        works = [self.group.recv([acknowledgement], dst, tag), self.group.send([header], dst, 0),
                 self.group.send([packed], dst, tag)]
        self._wait_in_background(handle, works[1:] + works[:1], "DONE")
        return handle

    def poll(self, handle: Any) -> str:
        """``"DONE"`` once the blocks are in place, ``"PROC"`` before, ``"ERR"`` if the peer failed."""

        state = handle["state"]
        if state != "RECEIVED":
            return state
        if handle["blocks"]:
            index = torch.tensor(handle["blocks"], dtype=torch.long)
            self.codec.unpack(slice(None), index, handle["buffer"])
        handle["state"] = "DONE"
        return "DONE"

    def _serve(self) -> None:
        """Owner side, in its own thread: answer every read, store every write, then note what was done."""

        offset = self._FIELDS + self._NOTE
        while True:
            header = torch.zeros(self._header_size(), dtype=torch.int64)
            try:
                self.group.recv_anysource([header], 0).wait()
                tag, peer, count, note_len, kind, first, layers = (int(x) for x in header[:self._FIELDS])
                note = header[self._FIELDS:offset].numpy().tobytes()[:note_len]
                index = header[offset:offset + count].clone()
                if kind == self._WRITE:
                    # The blocks were reserved for the sender's request and nothing reads them until
                    # the front end hears the write is done, so storing them from this thread is safe.
                    packed = torch.empty(self.codec.size(layers, count), dtype=torch.uint8)
                    self.group.recv([packed], peer, tag).wait()
                    if self.store_delay_s:
                        time.sleep(self.store_delay_s)
                    self.codec.unpack(slice(first, first + layers), index, packed)
                    self.group.send([torch.ones(1, dtype=torch.int64)], peer, tag).wait()
                    continue
                if count:
                    packed = self.codec.pack(slice(None), index)
                    self.group.send([packed], peer, tag).wait()
            except RuntimeError:
                return  # the group is broken (a peer died): transfers under way run into their lease
            with self._lock:
                self._notes.append(note)

    def notify(self, peer: str, message: bytes) -> None:
        """Tell ``peer`` its blocks will not be read: an empty read that only delivers the notification."""
        self.start_read(peer, [], [], message)

    def notifications(self) -> list[bytes]:
        """Notifications of reads of our blocks that completed since the last call."""
        with self._lock:
            notes, self._notes = self._notes, []
        return notes


def rendezvous_store(address: str, rank: int, world_size: int, timeout: Any, hosted: bool = False) -> Any:
    """The ``torch.distributed`` store the workers meet at: ``tcp://HOST:PORT`` (rank 0 serves it, listening
    on HOST only: torch's own store would listen on every interface; or, when ``hosted``, the front end
    already serves it there and every rank is a client) or ``env://`` (torchrun's)."""
    import torch.distributed as dist

    if not address.startswith("tcp://"):
        store, _, _ = next(dist.rendezvous(address, rank, world_size, timeout=timeout))
        return store
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    if rank or hosted:
        return dist.TCPStore(host, int(port), world_size, False, timeout=timeout)
    return _serve_store(host, int(port), world_size, timeout)


def host_store(host: str = "127.0.0.1", timeout_s: float = 120) -> tuple[Any, str]:
    """Serve a ``torch.distributed`` store on ``host`` at a port the system picks, and say where: the
    front end of spawned workers hosts their store itself, so no port is chosen early and taken by
    someone else before the store binds it."""
    import datetime

    store = _serve_store(host, 0, 1, datetime.timedelta(seconds=timeout_s))
    return store, f"tcp://{host}:{store.port}"


def _serve_store(host: str, port: int, world_size: int, timeout: Any) -> Any:
    import socket

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host.strip("[]"), port))
    listener.listen(128)
    port = listener.getsockname()[1]
    # detach(): the store owns the descriptor from now on, so Python never closes it under the store.
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach(), use_libuv=False)


TRANSPORTS = {"nixl": NixlTransport, "torch": TorchDistributedTransport}
