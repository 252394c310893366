"""Prefill/decode disaggregation: workers in separate processes, K/V moved between them (chapter 05)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (for type checkers and editors; at run time each name is imported on first use)
    from minipd.pd.llm import DisaggregatedLLM, WorkerError

#: Where each public name lives; imported when first asked for, so importing a light module of this
#: package (the scheduler, say) does not pull in torch.
_WHERE = {
    "DisaggregatedLLM": "minipd.pd.llm",
    "WorkerError": "minipd.pd.llm",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = ["DisaggregatedLLM", "WorkerError"]
