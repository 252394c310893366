"""Running an :class:`~minipd.engine.core.EngineCore` behind queues: in a thread, or in another process.

The core loop owns the core: it takes messages (the typed commands of
:mod:`minipd.engine.core_messages`: add, abort, import/export/release K/V, shut down), steps while
there is work, and sends each step's :class:`~minipd.engine.request.EngineCoreOutputs` back. A
client submits from any thread and reads outputs. This is the shape a server, a prefill or decode
worker and an expert-parallel rank use: the model runs in its own loop, requests arrive whenever.

- :meth:`CoreClient.in_thread` runs the loop in a background thread over ``queue.Queue``.
- :meth:`CoreClient.in_process` spawns a process that loads the model and builds its own core;
  messages travel over ZeroMQ push/pull sockets on local IPC paths in a private folder, typed and
  signed with a fresh key (:mod:`minipd.wire`: nothing received is unpickled). If the process dies,
  the client says so (:class:`EngineDeadError`) instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any

from minipd.engine import core_messages as cm
from minipd.engine.core import EngineCore
from minipd.engine.core_messages import CoreError, CoreReady, ExportedKV
from minipd.engine.request import EngineCoreOutputs, FinishReason, Request
from minipd.kv.paged_pool import PackedKV
from minipd.messages import Message
from minipd.wire import Codec, new_key, send_nowait
from minipd.wire import receive as wire_receive


class EngineDeadError(RuntimeError):
    """The engine core's thread or process is gone; requests sent to it will not finish."""


#: How long an otherwise busy loop waits for a message when a step could run nothing (e.g. every
#: request waits for K/V from elsewhere), instead of spinning.
STALLED_WAIT = 0.01


def handle_message(core: EngineCore, message: Any, send: Any) -> bool:
    """Apply one message to ``core``; return False on shutdown. Errors go back as :class:`CoreError`."""
    if not isinstance(message, Message):
        send(CoreError(None, f"ignored a message that is not a command: {message!r:.200}"))
        return True
    try:
        if isinstance(message, cm.AddRequest):
            core.add_request(message.request, message.kv)
        elif isinstance(message, cm.AbortRequests):
            outputs = core.abort_requests(message.request_ids, message.reason)
            if outputs:
                send(EngineCoreOutputs(outputs, time.perf_counter()))
        elif isinstance(message, cm.ImportKV):
            core.import_kv(message.request_id, message.kv)
        elif isinstance(message, cm.FinishKVLoad):
            core.finish_kv_load(message.request_id)
        elif isinstance(message, cm.ExportKV):
            send(ExportedKV(message.request_id, core.export_kv(message.request_id, message.num_tokens)))
        elif isinstance(message, cm.ReleaseKV):
            core.release_kv(message.request_id)
        elif isinstance(message, cm.Shutdown):
            return False
        else:
            send(CoreError(None, f"unknown message {type(message).__name__}"))
    except Exception as err:  # a bad request must not take the loop (and every other request) down
        request = getattr(message, "request", None)
        request_id = request.request_id if request is not None else getattr(message, "request_id", None)
        send(CoreError(request_id, f"{type(err).__name__}: {err}"))
    return True


def run_core_loop(core: EngineCore, receive: Any, send: Any) -> None:
    """Serve messages and step until shutdown. ``receive(timeout)`` returns a message or None (None: wait)."""
    stalled = False
    while True:
        # Block while idle; when busy, only take what has already arrived, then step.
        if not core.has_unfinished_requests():
            wait: float | None = None
        else:
            wait = STALLED_WAIT if stalled else 0.0
        message = receive(wait)
        while message is not None:
            if not handle_message(core, message, send):
                return
            message = receive(0.0)
        if core.has_unfinished_requests():
            try:
                outputs = core.step()
            except Exception as err:  # rolled back (see EngineCore.step): say so, and try again after a pause
                send(CoreError(None, f"a step failed and was rolled back: {type(err).__name__}: {err}"))
                stalled = True
                continue
            stalled = outputs.num_scheduled_tokens == 0
            if outputs.outputs:
                send(outputs)
            failure = core.take_failure()  # after the step's tokens were sent: nothing is lost
            if failure is not None:
                send(CoreError(None, f"{type(failure).__name__}: {failure}"))


class CoreClient:
    """Submit to an engine core running elsewhere and read its outputs; safe to call from several threads."""

    def __init__(self, send: Any, receive: Any, is_alive: Any, stop: Any) -> None:
        self._send, self._receive, self._is_alive, self._stop = send, receive, is_alive, stop
        # One lock per direction: a reader waiting for output never holds up a writer.
        self._send_lock = threading.Lock()
        self._receive_lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------------------ factories
    @classmethod
    def in_thread(cls, core: EngineCore) -> CoreClient:
        """Run ``core``'s loop in a daemon thread of this process."""
        inbox: queue.Queue = queue.Queue()
        outbox: queue.Queue = queue.Queue()

        def receive(timeout: float | None) -> Any:
            try:
                return inbox.get(timeout=timeout) if timeout != 0.0 else inbox.get_nowait()
            except queue.Empty:
                return None

        def loop() -> None:
            try:
                run_core_loop(core, receive, outbox.put)
            except BaseException as err:  # report, then let the client see the thread is gone
                outbox.put(CoreError(None, f"engine core died: {type(err).__name__}: {err}"))

        thread = threading.Thread(target=loop, name="minipd-engine-core", daemon=True)
        thread.start()

        def get(timeout: float | None) -> Any:
            try:
                return outbox.get(timeout=timeout)
            except queue.Empty:
                return None

        def put(message: Any, patience: float | None = None) -> None:
            inbox.put(message)  # (a queue always takes it)

        return cls(put, get, thread.is_alive, lambda grace: thread.join(timeout=10))

    @classmethod
    def in_process(cls, model: str | os.PathLike, start_timeout: float = 120.0, **llm_options: Any) -> CoreClient:
        """Spawn a process that loads ``model`` (as :class:`~minipd.llm.LLM` would, with ``llm_options``)
        and serves its core. Waits until it is ready, up to ``start_timeout`` seconds.

        The process is started with ``spawn`` (safe with CUDA and threads), which imports the calling
        script again: in a script, call this under ``if __name__ == "__main__":``.
        """
        import zmq

        folder = tempfile.mkdtemp(prefix="minipd-core-")
        to_core, from_core = _addresses(folder)
        context = zmq.Context.instance()
        push = context.socket(zmq.PUSH)
        push.bind(to_core)
        pull = context.socket(zmq.PULL)
        pull.bind(from_core)
        codec = Codec(new_key())
        process = mp.get_context("spawn").Process(target=_serve_in_process, args=(str(model), llm_options, folder,
                                                                                   codec.key), daemon=True)
        process.start()

        send, receive = _channel(push, pull, process.is_alive, codec)

        def stop(grace: float) -> None:
            process.join(timeout=grace)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
            push.close(linger=0)
            pull.close(linger=0)
            abandon()

        client = cls(send, receive, process.is_alive, stop)
        # Also when the client is dropped without a shutdown, or at interpreter exit: its process and sockets go.
        abandon = weakref.finalize(client, _abandon, process, folder, os.getpid())
        client.process = process
        client.socket_folder = folder
        client.info = client._wait_ready(start_timeout)
        return client

    def _wait_ready(self, timeout: float) -> CoreReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self._receive(0.2)
            if isinstance(message, CoreReady):
                return message
            if isinstance(message, CoreError):
                self.shutdown()
                raise EngineDeadError(message.message)
            if not self._is_alive():
                self.shutdown()
                raise EngineDeadError("the engine core process exited while starting")
        self.shutdown()
        raise TimeoutError(f"the engine core process was not ready after {timeout:.0f} s")

    # ------------------------------------------------------------------------------- requests
    def add_request(self, request: Request, kv: PackedKV | None = None) -> None:
        """Queue ``request`` in the core (a refusal comes back as a :class:`CoreError` output)."""
        self._submit(cm.AddRequest(request, kv))

    def abort_requests(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """End requests now; each live one comes back once more with finish reason ``reason``.

        Pass ``FinishReason.STOP`` when the front end found a stop string (a ``hold_kv`` request then keeps its K/V).
        """
        self._submit(cm.AbortRequests(list(request_ids), reason))

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_kv`` request kept."""
        self._submit(cm.ReleaseKV(request_id))

    def import_kv(self, request_id: str, kv: PackedKV) -> None:
        """Hand over the K/V a request added with ``num_external_tokens`` waits for."""
        self._submit(cm.ImportKV(request_id, kv))

    def finish_kv_load(self, request_id: str) -> None:
        """Say that a transport wrote the request's K/V into its blocks directly."""
        self._submit(cm.FinishKVLoad(request_id))

    def export_kv(self, request_id: str, num_tokens: int | None = None) -> None:
        """Ask for a request's K/V: an :class:`ExportedKV` comes back among the outputs."""
        self._submit(cm.ExportKV(request_id, num_tokens))

    def _submit(self, message: Message) -> None:
        if self.closed:
            raise EngineDeadError("the engine core client is shut down")
        if not self._is_alive():
            raise EngineDeadError("the engine core is not running")
        with self._send_lock:  # ZeroMQ sockets are not thread-safe; queue.Queue does not mind
            self._send(message)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | CoreError | ExportedKV:
        """The next step's outputs (or an error report); waits up to ``timeout`` seconds.

        Raises :class:`EngineDeadError` when the core is gone, ``TimeoutError`` when nothing came in time.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            with self._receive_lock:
                message = self._receive(wait)
            if message is not None:
                return message
            if not self._is_alive():
                raise EngineDeadError("the engine core stopped before answering")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no output from the engine core within {timeout} s")

    def shutdown(self) -> None:
        """Stop the core loop and wait for it (killing a process that does not stop in 10 s, or at once if it
        could not even be told to: stopped, or stuck before it connected)."""
        if self.closed:
            return
        self.closed = True
        told = False
        # Briefly, lock included: a core stopped or stuck before it connected never takes the goodbye, and one
        # wedged with a full queue holds a submitting thread (and the lock) until it is killed, which is next.
        if self._is_alive() and self._send_lock.acquire(timeout=1.0):
            try:
                self._send(cm.Shutdown(), patience=1.0)
                told = True
            except Exception:  # already going away, or not listening
                pass
            finally:
                self._send_lock.release()
        self._stop(10.0 if told else 0.0)

    def __enter__(self) -> CoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _channel(push: Any, pull: Any, peer_alive: Any, codec: Codec) -> tuple[Any, Any]:
    """``send(message)`` and ``receive(timeout) -> message | None`` over a ZeroMQ push/pull pair.

    Sends do not block for ever (see :func:`minipd.wire.send_nowait`): once the peer is gone they raise
    :class:`EngineDeadError`. A message received that is not signed with ``codec``'s key, or not well
    formed, is logged and dropped.
    """

    def send(message: Any, patience: float | None = None) -> None:
        send_nowait(push, codec.encode(message), peer_alive, EngineDeadError,
                    "the other end of the engine core's queue", patience)

    def receive(timeout: float | None) -> Any:
        return wire_receive(pull, codec, timeout, "engine core channel")

    return send, receive


def _abandon(process: Any, folder: str, owner: int) -> None:
    """What a client leaves behind when it goes without a shutdown: kill its core process and remove its socket
    folder. Only in the process that made them (a forked child's exit must not take its parent's sockets)."""
    if os.getpid() != owner:
        return
    if process.is_alive():
        process.kill()
        process.join(timeout=10)
    _remove_socket_folder(folder)


#: The IPC sockets :meth:`CoreClient.in_process` makes in its private folder: to the core, from the core.
_SOCKETS = ("in", "out")


def _addresses(folder: str) -> tuple[str, str]:
    """ZeroMQ addresses of the two sockets in ``folder``: to the core, from the core."""
    to_core, from_core = (f"ipc://{os.path.join(folder, name)}" for name in _SOCKETS)
    return to_core, from_core


def _remove_socket_folder(folder: str) -> None:
    """Remove the two IPC socket files of :meth:`CoreClient.in_process` and their folder; only those (a folder
    holding anything else is left where it is)."""
    for name in _SOCKETS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _serve_in_process(model: str, llm_options: dict, folder: str, key: bytes) -> None:
    """Entry point of the spawned core process: load the model, build the core, serve until shutdown.

    ``folder`` holds the client's two sockets (``in``, ``out``)."""
    import zmq

    to_core, from_core = _addresses(folder)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(to_core)
    push = context.socket(zmq.PUSH)
    push.connect(from_core)

    parent = os.getppid()

    def parent_alive() -> bool:
        return os.getppid() == parent  # re-parented (to init) once the parent is gone

    send, wait_for = _channel(push, pull, parent_alive, Codec(key))

    def receive(timeout: float | None) -> Any:
        # Never wait blind: a parent killed without a goodbye must not leave this process (and its GPU) behind.
        while True:
            message = wait_for(1.0 if timeout is None else timeout)
            if message is not None or timeout is not None:
                return message
            if not parent_alive():
                raise SystemExit(0)

    built = None
    try:
        from minipd.engine.factory import build_core
        from minipd.engine.front_end import eos_token_ids
        from minipd.tokenizer import Tokenizer

        built = build_core(model, **llm_options)
        core = built.core
        send(CoreReady(os.getpid(), core.kv_spec.to_dict(), core.block_manager.num_blocks, core.max_model_len,
                       sorted(eos_token_ids(built.model.config, Tokenizer(built.model_path)))))
        run_core_loop(core, receive, send)
    except (SystemExit, EngineDeadError):
        pass  # the parent is gone: nobody to tell
    except BaseException as err:  # tell the client, then exit
        with contextlib.suppress(EngineDeadError):
            send(CoreError(None, f"engine core process failed: {type(err).__name__}: {err}\n"
                                 f"{traceback.format_exc()}"))
    finally:
        if built is not None:
            built.close()
        push.close(linger=1000)
        pull.close(linger=0)
        context.term()
        if not parent_alive():  # killed without a goodbye, the parent cannot remove its sockets any more
            _remove_socket_folder(folder)
