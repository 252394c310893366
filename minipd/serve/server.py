"""``python -m minipd serve``: an engine (colocated, or disaggregated with ``--prefill-workers``/``--decode-workers``)
behind the OpenAI-compatible API, on uvicorn.

Binds 127.0.0.1 unless ``--host`` names another address. On SIGTERM or Ctrl-C, uvicorn stops accepting
connections and lets the requests in flight finish for ``--grace`` seconds; those still running then are
cancelled (which aborts them in the engine), and the engine is shut down — its thread, and a
disaggregated engine's worker processes, with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

#: Seconds the requests in flight get to finish after SIGTERM before they are cancelled.
GRACE_S = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` command's options."""
    parser.add_argument("--model", default="tiny-py", help="bundled name or local HF folder (default tiny-py)")
    parser.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--prefill-workers", type=int, default=0,
                        help="serve through DisaggregatedLLM with this many prefill workers (default 0: colocated)")
    parser.add_argument("--decode-workers", type=int, default=None,
                        help="decode workers when disaggregated (default 1; needs --prefill-workers)")
    parser.add_argument("--kv-transfer", default=None, help="disaggregated: pull, push or layerwise")
    parser.add_argument("--kv-transport", default=None, help="disaggregated: nixl or torch")
    parser.add_argument("--kv-transfer-dtype", default=None, help="disaggregated: int8, fp8 or int4_per_token")
    parser.add_argument("--kv-cache-dtype", default=None, help="KV cache format (chapter 06), e.g. int8")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks in each engine's pool")
    parser.add_argument("--expert-parallel-size", type=int, default=None,
                        help="MoE: ranks the experts are sharded over")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="any other engine option, VALUE read as JSON when it parses (repeatable), "
                             "e.g. --option max_num_seqs=64 --option enable_prefix_caching=false")
    parser.add_argument("--grace", type=float, default=GRACE_S,
                        help=f"seconds requests in flight get to finish on shutdown (default {GRACE_S})")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="largest request body taken")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="admission control: turn requests away (503) while this many are in flight")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords the flags ask for (only those given, so each engine keeps its defaults)."""
    options: dict[str, Any] = {}
    for name in ("kv_cache_dtype", "num_kv_blocks", "expert_parallel_size", "max_model_len", "seed"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    for item in args.option:
        name, sep, raw = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--option takes NAME=VALUE, got {item!r}")
        try:
            options[name] = json.loads(raw)
        except ValueError:
            options[name] = raw
    if args.prefill_workers:
        options.update(num_prefill_workers=args.prefill_workers,
                       num_decode_workers=1 if args.decode_workers is None else args.decode_workers)
        for name in ("kv_transfer", "kv_transport", "kv_transfer_dtype"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
    else:
        given = [f"--{n.replace('_', '-')}" for n in ("decode_workers", "kv_transfer", "kv_transport",
                                                       "kv_transfer_dtype") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to a disaggregated engine: add --prefill-workers N")
    return options


def build_engine(model: str, options: dict[str, Any]) -> Any:
    """An :class:`~minipd.async_llm.AsyncLLM` over ``LLM`` or, with ``num_prefill_workers``, ``DisaggregatedLLM``.

    A server's engine is long-lived (``long_lived=True`` unless the options say otherwise): under
    ``compile_decode="auto"`` its decode steps are compiled, in the background."""
    from minipd.async_llm import AsyncLLM

    options = {"long_lived": True, **options}
    if options.get("num_prefill_workers"):
        from minipd.pd.llm import DisaggregatedLLM

        llm: Any = DisaggregatedLLM(model, **options)
    else:
        from minipd.llm import LLM

        llm = LLM(model, **options)
    return AsyncLLM.from_llm(llm, owned=True)


def uvicorn_server(app: Any, host: str, port: int, grace: float) -> Any:
    """A uvicorn server for ``app``: quiet (warnings only, no access log), no lifespan events, and ``grace``
    seconds for requests in flight when it is told to stop."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         lifespan="off", timeout_graceful_shutdown=max(grace, 0.01)))


async def serve_app(app: Any, host: str, port: int, grace: float,
                    on_ready: Callable[[str], None] | None = None) -> None:
    """Run ``app`` on uvicorn until SIGTERM/SIGINT (or until the task is cancelled); ``on_ready`` gets the URL."""
    server = uvicorn_server(app, host, port, grace)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()
        if on_ready is not None:
            on_ready(f"http://{bound[0]}:{bound[1]}")

    watcher = asyncio.ensure_future(announce())
    try:
        await server.serve()
    finally:
        watcher.cancel()


class BackgroundServer:
    """The API over ``engine`` (an ``AsyncLLM``) on uvicorn in a thread of this process: for notebooks and tests.

    ``with BackgroundServer(engine, "tiny-py") as server:`` starts it (``server.url`` is
    ``http://127.0.0.1:PORT``, a free port unless one is given) and stops it on the way out; the engine is
    the caller's to shut down. ``app_options`` go to :func:`~minipd.serve.app.build_app` (``admission``,
    ``max_body_bytes``).
    """

    def __init__(self, engine: Any, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 grace: float = GRACE_S, **app_options: Any) -> None:
        import threading

        from minipd.serve.app import build_app

        self.engine, self.model_name = engine, model_name
        self.app = build_app(engine, model_name, **app_options)
        self._server = uvicorn_server(self.app, host, port, grace)
        self._thread = threading.Thread(target=self._run, name="minipd-server", daemon=True)
        self.url = ""
        #: The event loop the server runs in (set once started): coroutines may be sent to it.
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self._server.serve()

        asyncio.run(serve())

    @property
    def api(self) -> Any:
        """The handlers (:class:`minipd.serve.app.Api`): its ``metrics`` among them."""
        return self.app.state.api

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; returns the base URL once the socket is listening."""
        import time

        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout:.0f} s")
            time.sleep(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, give requests in flight the grace period, and wait for the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.api.metrics.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(args: argparse.Namespace) -> int:
    """The ``serve`` command."""
    from minipd.serve.app import MAX_BODY_BYTES, build_app

    options = engine_options(args)
    limit = args.max_in_flight
    if limit is not None and limit < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {limit}")
    name = args.served_model_name or str(args.model)
    print(f"minipd: loading {args.model} ({'disaggregated' if args.prefill_workers else 'colocated'})...",
          flush=True)
    engine = build_engine(args.model, options)
    info = engine.llm.describe()
    compiled = info.get("compile_decode", info.get("decode_engine", {}).get("compile_decode", "off"))
    print(f"minipd: compiled decode steps: {compiled}", flush=True)
    try:
        admission = None if limit is None else (lambda load: load.in_flight < limit)
        app = build_app(engine, name, args.max_body_bytes or MAX_BODY_BYTES, admission)

        def ready(url: str) -> None:
            print(f"minipd: serving {name} at {url}/v1 (OpenAI API; /metrics, /health)", flush=True)

        # uvicorn drains on SIGTERM, then raises the signal again with the handler it found: make that one a
        # no-op, so the engine below is shut down (threads, worker processes) instead of the process dying.
        signal.signal(signal.SIGTERM, lambda *_: None)
        asyncio.run(serve_app(app, args.host, args.port, args.grace, ready))
    finally:
        began = time.perf_counter()
        engine.shutdown()
        print(f"minipd: stopped (the engine took {time.perf_counter() - began:.1f} s to shut down)", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="python -m minipd.serve.server")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
