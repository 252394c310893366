"""OpenAI's request and response shapes, read and written by hand: a request body becomes a prompt and a
:class:`~minipd.sampling_params.SamplingParams`, or an :class:`ApiError` naming the offending field.

Every check names its field in ``param`` (``"max_tokens"``, ``"messages[1].content"``,
``"stream_options.include_usage"``), including those :class:`SamplingParams` makes itself, so a client
learns what to fix from the error alone. Unknown fields are refused rather than ignored: a parameter the
server does not act on should not look accepted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from minipd.errors import ParameterError
from minipd.sampling_params import SamplingParams


class ApiError(Exception):
    """An error the server answers with ``{"error": {message, type, param, code}}`` and HTTP ``status``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body (``code`` is the HTTP status, as vLLM has it)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


#: Fields both endpoints take and pass to :class:`SamplingParams` under the same name.
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output",
             "skip_special_tokens")
#: Accepted and without effect here (who the request is for; OpenAI's bookkeeping).
_IGNORED = ("user", "metadata", "store", "service_tier")
#: OpenAI fields minipd does not implement: accepted only at their neutral value.
_NEUTRAL = {"logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
            "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
            "parallel_tool_calls": (None, False), "functions": (None, []), "function_call": (None, "none")}
_COMMON = {"model", "stream", "stream_options", "n", "max_tokens", *_SAMPLING, *_IGNORED, *_NEUTRAL}
COMPLETION_FIELDS = frozenset({*_COMMON, "prompt", "logprobs"})
CHAT_FIELDS = frozenset({*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "add_generation_prompt", "chat_template"})
#: OpenAI's caps on log-probabilities: 5 alternatives for completions, 20 for chat.
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20


@dataclass
class ParsedRequest:
    """What a request asks for, checked."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    #: Chat: the conversation's messages (rendered into ``prompt`` by the chat template).
    messages: list[dict[str, str]] | None = None
    chat: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: The field that set ``max_tokens`` (chat's newer name is ``max_completion_tokens``), for errors.
    max_tokens_field: str = "max_tokens"
    #: Chat without a token limit: the reply may use the rest of the model's context (OpenAI's and vLLM's
    #: default), set once the prompt's length is known.
    until_context: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_known(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed:
            raise ApiError(f"{name!r} is not a field minipd's server takes here", param=name)
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise ApiError(f"{name} is not supported by minipd's server (only its default, "
                           f"{neutral[-1]!r}, is accepted)", param=name)


def check_model(body: dict[str, Any], model_name: str) -> None:
    """The ``model`` field, when given, must name the served model (404 otherwise, as OpenAI answers)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(f"model must be a string, got {type(model).__name__}", param="model")
    if model != model_name:
        raise ApiError(f"The model {model!r} does not exist; this server serves {model_name!r}", param="model",
                       status=404, kind="NotFoundError")


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    if not stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")
    for name in options:
        if name == "continuous_usage_stats" and options[name] is not None and options[name] is not False:
            # vLLM's extension (usage in every chunk): not implemented here, so not accepted as if it were.
            raise ApiError("continuous_usage_stats is not supported by minipd's server (only false); ask for "
                           "include_usage to get one usage chunk at the end",
                           param="stream_options.continuous_usage_stats")
        if name not in ("include_usage", "continuous_usage_stats"):
            raise ApiError(f"{name!r} is not a stream option minipd takes", param=f"stream_options.{name}")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise ApiError(f"include_usage must be true or false, got {usage!r}", param="stream_options.include_usage")
    return stream, usage


def _sampling(body: dict[str, Any], max_tokens: Any, logprobs: int | None) -> SamplingParams:
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(f"n must be 1: minipd's server returns one choice per request (got {n!r}); send several "
                       "requests for several samples", param="n")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ApiError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    options = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = options.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ApiError(f"{name} must be a finite number, got {value!r}", param=name)
    try:
        return SamplingParams(max_tokens=16 if max_tokens is None else max_tokens, logprobs=logprobs, **options)
    except ParameterError as err:
        raise ApiError(str(err), param=err.param) from None
    except (TypeError, ValueError) as err:
        raise ApiError(str(err)) from None


def parse_completion(body: dict[str, Any], model_name: str) -> ParsedRequest:
    """``POST /v1/completions``: ``prompt`` (a string or a list of token ids) and the sampling fields."""
    _check_known(body, COMPLETION_FIELDS)
    check_model(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("prompt must be one prompt (a string or a list of token ids); send one request per prompt",
                       param="prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt))):
        raise ApiError("prompt must be a string or a list of token ids", param="prompt")
    if not prompt:
        raise ApiError("prompt must not be empty", param="prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise ApiError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs!r}",
                       param="logprobs")
    stream, usage = _stream_options(body)
    return ParsedRequest(prompt, _sampling(body, body.get("max_tokens"), logprobs), stream, usage)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    checked = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ApiError("each message must be an object with role and content", param=f"messages[{i}]")
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant", "developer"):
            raise ApiError(f"role must be one of system, developer, user, assistant; got {role!r}",
                           param=f"messages[{i}].role")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError("content parts must all be {type: 'text', text: ...} (minipd's models read text "
                               "only)", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError("content must be a string (or a list of text parts)", param=f"messages[{i}].content")
        for key in message:
            if key not in ("role", "content", "name"):
                raise ApiError(f"{key!r} is not a message field minipd takes", param=f"messages[{i}].{key}")
        checked.append({"role": "system" if role == "developer" else role, "content": content})
    return checked


def parse_chat(body: dict[str, Any], model_name: str) -> ParsedRequest:
    """``POST /v1/chat/completions``: ``messages``, ``logprobs`` (true/false) with ``top_logprobs``, and the
    sampling fields; ``max_completion_tokens`` is the newer name of ``max_tokens``."""
    _check_known(body, CHAT_FIELDS)
    check_model(body, model_name)
    messages = _messages(body.get("messages"))
    logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise ApiError(f"logprobs must be true or false for chat, got {logprobs!r}", param="logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                           param="top_logprobs")
        if not logprobs:
            raise ApiError("top_logprobs needs logprobs to be true", param="top_logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    try:
        params = _sampling(body, max_tokens, (top or 0) if logprobs else None)
    except ApiError as err:
        if err.param == "max_tokens":
            err.param = param
        raise
    for name in ("add_generation_prompt",):
        if name in body and not isinstance(body[name], bool):
            raise ApiError(f"{name} must be true or false", param=name)
    if "chat_template" in body and not isinstance(body["chat_template"], (str, type(None))):
        raise ApiError("chat_template must be a string", param="chat_template")
    stream, usage = _stream_options(body)
    return ParsedRequest("", params, stream, usage, messages=messages, chat=True,
                         extra={"add_generation_prompt": body.get("add_generation_prompt", True),
                                "chat_template": body.get("chat_template")}, max_tokens_field=param,
                         until_context=max_tokens is None)


# ------------------------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object, from the engine's own token counts (never re-tokenised)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], rows: list[dict[int, float]], decode: Any,
                        offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, their log-probabilities, the top alternatives
    and each token's offset in the text."""
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": [next(iter(row.values())) for row in rows],
            "top_logprobs": [{decode(t): lp for t, lp in row.items()} for row in rows], "text_offset": offsets}


def chat_logprobs(rows: list[dict[int, float]], decode: Any, top: int) -> dict[str, Any]:
    """The chat shape: per token its text, log-probability, UTF-8 bytes and the ``top`` most likely."""
    content = []
    for row in rows:
        (chosen, logprob), *_ = row.items()
        text = decode(chosen)
        alternatives = sorted(row.items(), key=lambda item: -item[1])[:top]
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": decode(t), "logprob": lp, "bytes": list(decode(t).encode())}
                                         for t, lp in alternatives]})
    return {"content": content}


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "ApiError", "ParsedRequest", "chat_logprobs", "check_model",
           "completion_logprobs", "parse_chat", "parse_completion", "usage"]
