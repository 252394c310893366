"""Prefill/decode disaggregation: workers in separate processes, K/V moved between them (chapter 05)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minipd._lazy import lazy_exports

if TYPE_CHECKING:  # (for type checkers and editors; at run time each name is imported on first use)
    from minipd.pd.cluster import ClusterCore
    from minipd.pd.llm import DisaggregatedLLM
    from minipd.pd.processes import WorkerError
    from minipd.pd.routing import Phase, Router

#: Where each public name lives; imported when first asked for, so importing a light module of this
#: package (the scheduler, say) does not pull in torch.
_WHERE = {
    "DisaggregatedLLM": "minipd.pd.llm",
    "WorkerError": "minipd.pd.processes",
    "ClusterCore": "minipd.pd.cluster",
    "Phase": "minipd.pd.routing",
    "Router": "minipd.pd.routing",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

__all__ = ["ClusterCore", "DisaggregatedLLM", "Phase", "Router", "WorkerError"]
