"""minipd: a small, complete LLM inference engine, built chapter by chapter in the course.

    from minipd import LLM, SamplingParams
    llm = LLM("tiny-py")
    print(llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32))[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minipd._lazy import lazy_exports

if TYPE_CHECKING:  # (for type checkers and editors; at run time each name is imported on first use)
    from minipd.async_llm import AsyncLLM
    from minipd.llm import LLM
    from minipd.outputs import RequestMetrics, RequestOutput, RequestStream, StreamDelta
    from minipd.pd.llm import DisaggregatedLLM
    from minipd.sampling_params import SamplingParams

__version__ = "0.1.0"

#: Where each public name lives; imported when first asked for, so importing a light module of this
#: package (the scheduler, say) does not pull in torch.
_WHERE = {
    "AsyncLLM": "minipd.async_llm",
    "DisaggregatedLLM": "minipd.pd.llm",
    "LLM": "minipd.llm",
    "RequestMetrics": "minipd.outputs",
    "RequestOutput": "minipd.outputs",
    "RequestStream": "minipd.outputs",
    "SamplingParams": "minipd.sampling_params",
    "StreamDelta": "minipd.outputs",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

__all__ = [
    "LLM",
    "AsyncLLM",
    "DisaggregatedLLM",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StreamDelta",
    "__version__",
]
