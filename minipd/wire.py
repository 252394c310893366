"""Messages between minipd's processes: a typed encoding that never runs code, and a key that signs it.

Every control message minipd sends between processes — a request for a prefill or decode worker, a
step's outputs, a worker's hello, a core loop's answer — goes through :class:`Codec`. Nothing that
arrives on a socket is ever unpickled: unpickling runs whatever the bytes say (a ``__reduce__``
payload is a shell command), so a stray or hostile packet would own the process.

The encoding is MessagePack with a few extension types:

- tuples, sets and frozensets keep their type;
- dataclasses and enums are written as their qualified name and their fields (or value), and read
  back only when the name is on :data:`ALLOWED` — a fixed table, so the bytes choose among known
  types but never name a module to import or a function to call; dataclasses are rebuilt through
  their ``__init__``, so their own validation (``SamplingParams``'s, for instance) runs again;
- tensors travel as dtype, shape and raw bytes (only the plain dtypes in :data:`TENSOR_DTYPES`).

With a key (``Codec(key=...)``) each message carries an HMAC-SHA256 of its bytes, and a message
whose tag does not match is refused before it is decoded. Workers spawned by a front end get a fresh
random key; workers that join over TCP share the cluster secret (see :func:`cluster_secret`). A
message that cannot be accepted raises :class:`WireError`; receivers log it and drop the message
rather than crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import hmac
import importlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import msgpack

logger = logging.getLogger("minipd")

#: Dataclasses and enums a message may contain, by qualified name (module, attribute).
ALLOWED: dict[str, tuple[str, str]] = {
    f"{module}.{name}": (module, name) for module, name in [
        ("minipd.sampling_params", "SamplingParams"),
        ("minipd.engine.request", "Request"),
        ("minipd.engine.request", "RequestStatus"),
        ("minipd.engine.request", "FinishReason"),
        ("minipd.engine.request", "EngineCoreOutput"),
        ("minipd.engine.request", "EngineCoreOutputs"),
        ("minipd.engine.stats", "StepStats"),
        ("minipd.kv.block_manager", "BlockAllocation"),
        ("minipd.kv.paged_pool", "PackedKV"),
        ("minipd.kv.spec", "KVSpec"),
        ("minipd.pd.kv_layout", "PoolLayout"),
    ]
}
# The client/core-loop protocol (minipd.engine.core_messages), each name spelled out.
ALLOWED.update({f"minipd.engine.core_messages.{name}": ("minipd.engine.core_messages", name) for name in (
    "AddRequest", "AbortRequests", "ImportKV", "FinishKVLoad", "ExportKV", "ReleaseKV", "Shutdown", "CoreReady",
    "CoreError", "ExportedKV")})
# The prefill/decode protocol (minipd.pd.messages), each name spelled out.
ALLOWED.update({f"minipd.pd.messages.{name}": ("minipd.pd.messages", name) for name in (
    "AddRequest", "AddRemote", "AddPush", "Abort", "ReleaseKV", "Reserve", "Adopt", "ReleaseReservation", "AddPeer",
    "InjectFault", "AskStats", "Shutdown", "Configure", "Hello", "Ready", "Outputs", "Reserved", "KVLoaded",
    "KVFailed", "Notice", "Failure", "Heartbeat", "Stats")})
#: Tensor dtypes a message may carry (by torch's name).
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                 "float8_e4m3fn", "float8_e5m2")

_TUPLE, _DATACLASS, _ENUM, _TENSOR, _DTYPE, _SET, _FROZENSET = range(1, 8)
#: Bytes of an HMAC-SHA256 tag.
TAG_BYTES = 32
#: The cluster secret's environment variables and default file (see :func:`cluster_secret`).
SECRET_ENV = "MINIPD_CLUSTER_SECRET"
SECRET_FILE_ENV = "MINIPD_CLUSTER_SECRET_FILE"


class WireError(ValueError):
    """A message that cannot be accepted: not authenticated, malformed, or naming a type that is not allowed."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _allowed_class(name: str) -> type:
    if name not in ALLOWED:
        raise WireError(f"type {name!r} is not allowed in a message")
    module, attribute = ALLOWED[name]
    return getattr(importlib.import_module(module), attribute)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _default(obj: Any) -> Any:
    """How a value MessagePack has no type for is written (called for every such value)."""
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, enum.Enum):
        return msgpack.ExtType(_ENUM, _pack([_qualified(type(obj)), obj.value]))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_DATACLASS, _pack([_qualified(type(obj)), fields]))
    if isinstance(obj, frozenset):
        return msgpack.ExtType(_FROZENSET, _pack(sorted(obj, key=repr)))
    if isinstance(obj, set):
        return msgpack.ExtType(_SET, _pack(sorted(obj, key=repr)))
    # Subclasses of the plain types (strict_types sends them here) travel as the plain type.
    for plain in (bool, int, float, str, bytes, list, dict):
        if isinstance(obj, plain):
            return plain(obj)
    module = type(obj).__module__
    if module == "torch" or module.startswith("torch."):
        import torch

        if isinstance(obj, torch.dtype):
            return msgpack.ExtType(_DTYPE, _pack(str(obj).removeprefix("torch.")))
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return msgpack.ExtType(_TENSOR, _pack([str(t.dtype).removeprefix("torch."), list(t.shape), raw]))
    if module == "numpy":
        item = getattr(obj, "item", None)
        if item is not None and getattr(obj, "shape", None) == ():
            return item()  # a NumPy scalar: the Python number
    raise TypeError(f"a {type(obj).__name__} cannot be put in a message")


def _torch_dtype(name: Any) -> Any:
    import torch

    if name not in TENSOR_DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        raise WireError(f"tensor dtype {name!r} is not allowed in a message")
    return getattr(torch, name)


def _ext_hook(code: int, data: bytes) -> Any:
    """How an extension value is read back: only the types this module writes."""
    value = _unpack(data)
    if code == _TUPLE:
        return tuple(value)
    if code in (_SET, _FROZENSET):
        return (set if code == _SET else frozenset)(value)
    if code == _DTYPE:
        return _torch_dtype(value)
    if code == _ENUM:
        name, raw = value
        cls = _allowed_class(name)
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            raise WireError(f"{name!r} is not an enum")
        return cls(raw)
    if code == _DATACLASS:
        name, fields = value
        cls = _allowed_class(name)
        if not dataclasses.is_dataclass(cls) or not isinstance(fields, dict):
            raise WireError(f"{name!r} is not a dataclass, or its fields are not a mapping")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(fields) - set(known)
        if unknown:
            raise WireError(f"{name} has no field(s) {sorted(map(str, unknown))}")
        obj = cls(**{k: v for k, v in fields.items() if known[k].init})
        for k, v in fields.items():
            if not known[k].init:
                object.__setattr__(obj, k, v)  # (frozen dataclasses too)
        return obj
    if code == _TENSOR:
        import torch

        dtype_name, shape, raw = value
        dtype = _torch_dtype(dtype_name)
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise WireError(f"tensor shape {shape!r} is not a list of sizes")
        numel = 1
        for n in shape:
            numel *= n
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not isinstance(raw, bytes) or len(raw) != numel * itemsize:
            raise WireError(f"a {dtype_name} tensor of shape {shape} needs {numel * itemsize} bytes")
        if not numel:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    raise WireError(f"unknown extension type {code}")


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


class Codec:
    """Encode and decode messages; with ``key``, sign each and refuse any whose signature is wrong."""

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ValueError("the message key must be at least 16 bytes")
        self.key = key

    def encode(self, message: Any) -> bytes:
        """The bytes of ``message`` (tag first when signed). ``TypeError`` for a value with no encoding."""
        payload = _pack(message)
        if self.key is None:
            return payload
        return hmac.new(self.key, payload, hashlib.sha256).digest() + payload

    def decode(self, data: bytes) -> Any:
        """The message in ``data``; :class:`WireError` when it is not signed with our key or is malformed."""
        if self.key is not None:
            tag, data = data[:TAG_BYTES], data[TAG_BYTES:]
            if len(tag) < TAG_BYTES or not hmac.compare_digest(tag, hmac.new(self.key, data, hashlib.sha256).digest()):
                raise WireError("the message is not signed with this cluster's key")
        try:
            return _unpack(data)
        except WireError:
            raise
        except Exception as err:  # whatever the bytes were, they are not a message of ours
            raise WireError(f"malformed message ({type(err).__name__}: {err})") from None


def new_key() -> bytes:
    """A fresh random key for one cluster of processes started together."""
    return secrets.token_bytes(32)


def default_secret_file() -> Path:
    """Where the cluster secret of this user lives unless told otherwise: ``~/.config/minipd/cluster-secret``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "minipd" / "cluster-secret"


def cluster_secret(secret: str | bytes | os.PathLike | None = None, create: bool = False) -> bytes:
    """The key that processes joining over TCP sign their messages with.

    In order: ``secret`` (the secret itself as ``str``/``bytes``, or a path to a file holding it), the
    environment variable ``MINIPD_CLUSTER_SECRET`` (the secret), ``MINIPD_CLUSTER_SECRET_FILE`` (a
    file), then the user's file ``~/.config/minipd/cluster-secret`` (under ``$XDG_CONFIG_HOME`` when
    set). With ``create`` that file is made (readable by this user only) when it does not exist, so
    a front end and the workers a user starts on the same machine agree with no set-up; other
    machines need a copy of it (or the environment variable). A secret shorter than 16 bytes is
    refused.
    """
    if isinstance(secret, os.PathLike):
        return _read_secret(Path(secret))
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None and os.environ.get(SECRET_FILE_ENV):
        return _read_secret(Path(os.environ[SECRET_FILE_ENV]))
    if secret is not None:
        key = secret.encode() if isinstance(secret, str) else secret
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("secret must be at least 16 bytes (or characters)")
        return key
    path = default_secret_file()
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Written whole beside it, then linked into place (which fails if it exists): a process that
        # starts at the same moment reads the one secret that won, never a half-written file.
        staging = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another process made it first: use theirs
                os.link(staging, path)
        finally:
            staging.unlink()
    if not path.exists():
        raise ValueError(f"no cluster secret: set {SECRET_ENV} or {SECRET_FILE_ENV}, pass secret=, or create "
                         f"{path} (a front end with listen= creates it)")
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        key = path.read_bytes().strip()
    except OSError as err:
        raise ValueError(f"cannot read the cluster secret file {path}: {err}") from None
    if mode & 0o077:
        logger.warning("the cluster secret file %s is readable by other users; chmod 600 it", path)
    if len(key) < 16:
        raise ValueError(f"the cluster secret in {path} is shorter than 16 bytes")
    return key


def receive(socket: Any, codec: Codec, timeout: float | None, what: str) -> Any:
    """The next acceptable message on a ZeroMQ socket, waiting up to ``timeout`` seconds (None: for ever);
    None when none came. A message that is not signed with ``codec``'s key or not well formed is logged
    (naming ``what`` received it) and dropped, never acted on."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while socket.poll(None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))):
        data = socket.recv()
        try:
            return codec.decode(data)
        except WireError as err:
            logger.warning("%s: dropped a message of %d bytes: %s", what, len(data), err)
    return None


def send_nowait(socket: Any, data: bytes, peer_alive: Any, error: type[Exception], what: str,
                patience: float | None = None) -> None:
    """Send on a ZeroMQ push socket without blocking for ever: retried while ``peer_alive()``, else ``error``;
    with ``patience``, also ``error`` once that many seconds have gone by without the message being taken.

    (A push socket whose peer is gone would block a plain send until the peer came back; one whose peer is
    alive but never connected — a process stopped or stuck while it starts — until it connects.)
    """
    import zmq

    deadline = None if patience is None else time.monotonic() + patience
    while True:
        try:
            socket.send(data, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        except zmq.ZMQError as err:  # the socket (or its context) was closed under us
            raise error(f"{what}: cannot send ({err})") from None
        if not peer_alive():
            raise error(f"{what} is gone")
        if deadline is not None and time.monotonic() > deadline:
            raise error(f"{what} took no message for {patience:g} s")
        # Wait for room (not a busy loop: a peer that reads nothing for an hour costs no CPU), asking again
        # after at most 50 ms whether the peer is still there.
        wait_ms = 50 if deadline is None else max(1, min(50, int((deadline - time.monotonic()) * 1000)))
        try:
            socket.poll(wait_ms, zmq.POLLOUT)
        except zmq.ZMQError as err:
            raise error(f"{what}: cannot send ({err})") from None


__all__ = ["ALLOWED", "Codec", "WireError", "cluster_secret", "new_key", "receive", "send_nowait"]
