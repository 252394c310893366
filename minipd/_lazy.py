"""Lazy package exports (PEP 562): a package names where its public names live; each is imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names live in the modules of ``where``.

    So ``import minipd.engine.scheduler`` does not import torch through ``minipd/__init__.py``.
    """

    def getattr_(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted([*vars(importlib.import_module(package)), *where])

    return getattr_, dir_
