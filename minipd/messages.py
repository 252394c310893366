"""Typed messages between minipd's processes: frozen dataclasses whose fields are checked on arrival.

A :class:`Message` checks every field against its annotation when it is built — by the sender, and
again by :mod:`minipd.wire` on arrival, which rebuilds dataclasses through their ``__init__`` — so a
message with a field of the wrong type is refused before anything acts on it. The messages
themselves live beside the code that speaks them: :mod:`minipd.engine.core_messages` (a client and
its engine core loop) and :mod:`minipd.pd.messages` (the front end and its prefill/decode workers).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Union


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (the forms messages use: plain classes, unions
    and ``None``, ``list[X]``, ``tuple[X, ...]``, ``dict[K, V]``, ``Any``)."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(matches(v, args[0]) for v in value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return isinstance(value, tuple) and all(matches(v, args[0]) for v in value)
        return isinstance(value, tuple) and len(value) == len(args) and all(map(matches, value, args))
    if origin is dict:
        return isinstance(value, dict) and all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # (a form messages do not use)


@dataclasses.dataclass(frozen=True)
class Message:
    """Base of every message: its fields are checked against their annotations when it is built."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not matches(value, hints[f.name]):
                raise TypeError(f"{type(self).__name__}.{f.name} must be {_name(hints[f.name])}, "
                                f"got {type(value).__name__}: {value!r:.80}")


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


__all__ = ["Message", "matches"]
