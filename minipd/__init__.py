"""minipd: a small, complete LLM inference engine, built chapter by chapter in the course.

    from minipd import LLM, SamplingParams
    llm = LLM("tiny-py")
    print(llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32))[0].text)
"""

from minipd.async_llm import AsyncLLM
from minipd.llm import LLM
from minipd.outputs import RequestMetrics, RequestOutput, RequestStream, StreamDelta
from minipd.pd import DisaggregatedLLM
from minipd.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "DisaggregatedLLM", "RequestMetrics", "RequestOutput", "RequestStream", "SamplingParams",
           "StreamDelta", "__version__"]
