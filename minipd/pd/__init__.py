"""Prefill/decode disaggregation: workers in separate processes, K/V moved between them (chapter 05)."""

from minipd.pd.llm import DisaggregatedLLM, WorkerError

__all__ = ["DisaggregatedLLM", "WorkerError"]
