"""The OpenAI-compatible HTTP API over an :class:`~minipd.async_llm.AsyncLLM`, as a FastAPI app.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/health`` and ``/metrics``. Every error is OpenAI-shaped
(``{"error": {message, type, param, code}}``) with the field in ``param``.

A client that goes away stops its request in the engine at once: each handler races its work against
the connection's ``http.disconnect`` (vLLM's pattern), and a stream's generator, closed by the server
when the client is gone, aborts its request on the way out — its KV blocks come back within a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minipd.outputs import StreamDelta
from minipd.serve.metrics import ServerMetrics
from minipd.serve.protocol import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    check_model,
    completion_logprobs,
    now,
    parse_chat,
    parse_completion,
    usage,
)

#: Largest request body taken (bytes); larger ones get 413.
MAX_BODY_BYTES = 4 << 20


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object, refusing oversized bodies (413) before reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"the request body is {declared} bytes; this server takes at most {limit}", status=413,
                       kind="RequestTooLarge")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(f"the request body is over {limit} bytes, the most this server takes", status=413,
                           kind="RequestTooLarge")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise ApiError(f"the request body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ApiError("the request body must be a JSON object")
    return value


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (its request is aborted on the way out)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # (A cancelled task is only done once it has run its way out: wait for that, not its result.)
            await asyncio.wait({task})
    if task.cancelled():
        return Response(status_code=499)  # (nginx's "client closed request": nobody reads it)
    return task.result()


def _sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


@dataclass(frozen=True)
class Load:
    """What an admission rule sees when a request arrives."""

    #: Requests admitted by this server and not yet finished (exact: counted as they come and go).
    in_flight: int
    #: From the engine's last step: requests running, requests waiting (to be scheduled or for their K/V),
    #: and the share of KV blocks held by requests.
    running: int
    waiting: int
    kv_usage: float


#: An admission rule: True admits the request, False turns it away with 503 (load shedding).
AdmissionRule = Callable[[Load], bool]


class Api:
    """The handlers, over one engine; :func:`build_app` routes to them.

    ``admission``, when given, is asked before each completion is admitted: a request it refuses gets 503
    ``{"error": {"type": "ServiceUnavailable", ...}}`` at once instead of a long wait in the queue.
    """

    def __init__(self, engine: Any, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
                 admission: AdmissionRule | None = None) -> None:
        self.engine, self.model_name, self.max_body_bytes = engine, model_name, max_body_bytes
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(engine.llm, model_name)
        self.max_model_len = engine.llm.max_model_len
        self.admission = admission
        self._live: set[str] = set()  # requests admitted and not yet over
        #: Requests the admission rule turned away so far.
        self.num_refused = 0
        self._token_text: dict[int, str] = {}

    def load(self) -> Load:
        """The server's load now (see :class:`Load`)."""
        running, waiting, kv_usage = self.metrics.engine.load()
        return Load(len(self._live), running, waiting, kv_usage)

    def _admit(self) -> None:
        if self.admission is not None and not self.admission(self.load()):
            self.num_refused += 1
            raise ApiError("the server is at capacity and turned this request away; retry later", status=503,
                           kind="ServiceUnavailable")

    def token_text(self, token_id: int) -> str:
        """One token as text (cached: logprobs name every alternative)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # ------------------------------------------------------------------------------------ generation
    async def _start(self, parsed: ParsedRequest, request_id: str,
                     arrival: float) -> tuple[AsyncIterator[StreamDelta], StreamDelta]:
        """Admit the request and wait for its first delta, so that a refusal is still an HTTP error."""
        prompt: Any = parsed.prompt
        if parsed.chat:
            try:
                prompt = self.tokenizer.apply_chat_template(parsed.messages, parsed.extra["add_generation_prompt"],
                                                            parsed.extra["chat_template"])
            except Exception as err:
                raise ApiError(f"the chat template could not render these messages: {err}",
                               param="chat_template" if parsed.extra["chat_template"] else "messages") from None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        where = "messages" if parsed.chat else "prompt"
        if len(ids) >= self.max_model_len:
            raise ApiError(f"this model's context is {self.max_model_len} tokens; the prompt has {len(ids)}",
                           param=where)
        if parsed.until_context:
            parsed.params = dataclasses.replace(parsed.params, max_tokens=self.max_model_len - len(ids))
        if len(ids) + parsed.params.max_tokens > self.max_model_len:  # (the engine would cap it; OpenAI refuses)
            raise ApiError(f"this model's context is {self.max_model_len} tokens; the prompt has {len(ids)} and "
                           f"max_tokens asks for {parsed.params.max_tokens} more", param=parsed.max_tokens_field)
        self._check_fits_pool(len(ids), parsed, where)
        stream = self.engine.generate(ids, parsed.params, request_id=request_id, arrival_time=arrival).__aiter__()
        try:
            first = await stream.__anext__()
        except ValueError as err:  # refused on admission: prompt too long, request too big for the KV pool...
            await stream.aclose()
            param = getattr(err, "param", None) or ""
            if param.startswith("prompts["):
                param = where
            raise ApiError(str(err), param=param or None) from None
        return stream, first

    def _check_fits_pool(self, num_tokens: int, parsed: ParsedRequest, where: str) -> None:
        """Refuse a request that could never fit the KV pool, naming what to lower: the prompt when it alone
        is too big, else the field that set ``max_tokens``."""
        check = self.engine.llm.engine.core.check_fits
        for size, param in ((1, where), (parsed.params.max_tokens, parsed.max_tokens_field)):
            try:
                check(num_tokens, size, what=param)
            except ValueError as err:
                raise ApiError(str(err), param=param) from None

    def _finished(self, delta: StreamDelta) -> tuple[int, int]:
        """A finished request's (prompt, completion) token counts (its latencies are recorded by the engine's
        side of :class:`ServerMetrics`, also when its client has gone)."""
        output = delta.output
        return len(output.prompt_token_ids), len(output.token_ids)

    async def completion(self, body: dict[str, Any], chat: bool, arrival: float) -> Response:
        """A completion or chat completion of the request ``body`` (which arrived at ``arrival``, a
        ``perf_counter`` time), streamed or whole."""
        parsed = (parse_chat if chat else parse_completion)(body, self.model_name)
        self._admit()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._live.add(request_id)
        try:
            stream, first = await self._start(parsed, request_id, arrival)
        except BaseException:
            self._live.discard(request_id)
            raise
        if parsed.stream:
            events = self._events(parsed, request_id, stream, first)
            # Over when the events end, or, if the client left before they began, when they are dropped.
            weakref.finalize(events, self._live.discard, request_id)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, rows, delta = [], [], first
        try:
            while True:
                text.append(delta.text)
                if delta.logprobs is not None:
                    rows.append(delta.logprobs)
                if delta.finished:
                    break
                delta = await stream.__anext__()
        finally:
            await stream.aclose()
            self._live.discard(request_id)
        prompt_tokens, completion_tokens = self._finished(delta)
        content = "".join(text)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                      "logprobs": self._chat_logprobs(parsed, rows),
                                      "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": self._completion_logprobs(parsed, rows, 0),
                      "finish_reason": delta.finish_reason}
        return JSONResponse({"id": request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": now(), "model": self.model_name, "choices": [choice],
                             "usage": usage(prompt_tokens, completion_tokens)})

    def _completion_logprobs(self, parsed: ParsedRequest, rows: list[dict[int, float]], offset: int) -> Any:
        if parsed.params.logprobs is None:
            return None
        tokens = [self.token_text(next(iter(row))) for row in rows]
        return completion_logprobs(tokens, rows, self.token_text, offset)

    def _chat_logprobs(self, parsed: ParsedRequest, rows: list[dict[int, float]]) -> Any:
        if parsed.params.logprobs is None:
            return None
        return chat_logprobs(rows, self.token_text, parsed.params.logprobs)

    async def _events(self, parsed: ParsedRequest, request_id: str, stream: AsyncIterator[StreamDelta],
                      first: StreamDelta) -> AsyncIterator[bytes]:
        """The server-sent events of one streamed request: a chunk per token (its text may be empty while held
        back), the usage chunk when asked for, then ``[DONE]``. Closed early (the client left), it aborts the
        request."""
        chat, created, offset = parsed.chat, now(), 0
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]]) -> bytes:
            body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                                    "choices": choices}
            if parsed.include_usage:
                body["usage"] = None
            return _sse(body)

        try:
            if chat:  # the role comes first, alone
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            delta: StreamDelta | None = first
            while delta is not None:
                rows = [delta.logprobs] if delta.logprobs is not None else []
                # A chunk per token, also when its text is still held back (a partial character, a possible
                # stop string): clients time tokens by chunks, as they do with vLLM.
                if delta.token_id is not None or delta.finished:
                    if chat:
                        choice: dict[str, Any] = {"index": 0, "delta": {"content": delta.text} if delta.text else {},
                                                  "logprobs": self._chat_logprobs(parsed, rows) if rows else None,
                                                  "finish_reason": delta.finish_reason}
                    else:
                        choice = {"index": 0, "text": delta.text,
                                  "logprobs": self._completion_logprobs(parsed, rows, offset) if rows else None,
                                  "finish_reason": delta.finish_reason}
                    offset += len(delta.text)
                    yield chunk([choice])
                if delta.finished:
                    prompt_tokens, completion_tokens = self._finished(delta)
                    if parsed.include_usage:
                        yield _sse({"id": request_id, "object": kind, "created": created, "model": self.model_name,
                                    "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
                    yield _sse("[DONE]")
                    return
                delta = await stream.__anext__()
        finally:
            await stream.aclose()  # (aborts the request unless it finished)
            self._live.discard(request_id)

    # ---------------------------------------------------------------------------------------- others
    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        check_model(body, self.model_name)
        for name in body:
            if name not in ("model", "prompt", "messages", "add_generation_prompt"):
                raise ApiError(f"{name!r} is not a field /tokenize takes", param=name)
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise ApiError("add_generation_prompt must be true or false", param="add_generation_prompt")
        if "messages" in body:
            parsed = parse_chat({"messages": body["messages"]}, self.model_name)
            text = self.tokenizer.apply_chat_template(parsed.messages, add_generation_prompt)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ApiError("prompt must be a string (or give messages)", param="prompt")
        tokens = self.tokenizer.encode(text)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        check_model(body, self.model_name)
        tokens, vocab = body.get("tokens"), self.engine.llm.engine.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ApiError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        for name in body:
            if name not in ("model", "tokens"):
                raise ApiError(f"{name!r} is not a field /detokenize takes", param=name)
        return JSONResponse({"prompt": self.tokenizer.decode(tokens)})

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": now(),
                                            "owned_by": "minipd", "max_model_len": self.max_model_len}]}


def build_app(engine: Any, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
              admission: AdmissionRule | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`~minipd.async_llm.AsyncLLM`) as ``model_name``; see
    :class:`Api` for ``admission``."""
    api = Api(engine, model_name, max_body_bytes, admission)
    app = FastAPI(title="minipd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(str(err.detail), status=err.status_code, kind="invalid_request_error").body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        failure = ApiError(f"{type(err).__name__}: {err}", status=500, kind="InternalServerError")
        return JSONResponse(failure.body(), status_code=500)

    # The body is read first: only then may the disconnect watcher take the connection's messages.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()  # latencies count from here: parsing and queueing are waiting too
        body = await read_json(request, max_body_bytes)
        return await until_disconnect(request, api.completion(body, chat=False, arrival=arrival))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        body = await read_json(request, max_body_bytes)
        return await until_disconnect(request, api.completion(body, chat=True, arrival=arrival))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await api.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await api.detokenize(request)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(ApiError("the engine is not running", status=503, kind="ServiceUnavailable").body(),
                            status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


__all__ = ["MAX_BODY_BYTES", "AdmissionRule", "Api", "Load", "build_app", "read_json", "until_disconnect"]
