"""Errors that name what was wrong, so a caller (a server filling OpenAI's ``param``) can point at it."""

from __future__ import annotations


class ParameterError(ValueError):
    """A value that is not allowed. ``param`` names the field (``"temperature"``, ``"prompts[2]"``,
    ``"kv_cache_dtype"``); the message says what is allowed. A ``ValueError``, so ``except ValueError``
    still catches it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


__all__ = ["ParameterError"]
