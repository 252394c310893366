"""Per-step records of what the engine did, kept as data for the chapters to plot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    """One engine step: when, how long, what was in the batch, and the state of the KV pool after it."""

    start_time: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    #: Fraction of prompt tokens looked up so far that the prefix cache served.
    prefix_hit_rate: float
    num_preemptions: int
    #: The step's number since the engine started (0, 1, ...): older records may have been dropped.
    step: int = 0
    #: Requests holding blocks while their K/V arrive from elsewhere.
    num_waiting_for_kv: int = 0
    #: Every scheduled request's context after the step (its K/V length read by its last query): with the
    #: chunk sizes, what a step-time model needs to know about the attention a step did.
    num_context_tokens: int = 0
    #: The size of each prefill chunk computed this step, in batch order (decodes are not listed).
    prefill_chunk_sizes: tuple[int, ...] = ()
    #: Prompt tokens looked up in the prefix cache, and found there, since the engine started (counters).
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    #: Adaptive KV precision (``kv_cache_dtype="adaptive"``): the pool's usage (bytes), whether new
    #: requests are being compressed, how often that has switched so far, running compressed requests,
    #: and running requests compressed in place to make room so far.
    kv_usage: float = 0.0
    kv_compressing: bool = False
    kv_format_switches: int = 0
    num_compressed_running: int = 0
    kv_compressions: int = 0
    #: Mixture of experts with ``record_routing=True``: per MoE layer, the tokens each expert got this step
    #: and the mean entropy (nats) of the tokens' top-k weights.
    expert_counts: tuple[tuple[int, ...], ...] = ()
    router_entropy: tuple[float, ...] = ()
    #: Disaggregated serving: the worker that ran the step ("" for a colocated engine).
    worker: str = ""

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class RequestCounters:
    """Counters a front end keeps over every request it served (what a metrics endpoint exports)."""

    #: Prompt tokens of the requests received.
    prompt_tokens: int = 0
    #: Output tokens delivered.
    generation_tokens: int = 0
    #: Requests finished, by finish reason (``"stop"``, ``"length"``, ``"abort"``).
    finished: dict[str, int] = field(default_factory=dict)
