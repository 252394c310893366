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
    #: Each prefill chunk's context after the step (its request's computed tokens), aligned with the sizes.
    prefill_chunk_contexts: tuple[int, ...] = ()
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
    #: Seconds of :attr:`duration` the stepping thread was ready to run but waited for a core (Linux's run
    #: delay: other processes had the machine's cores); None where the operating system does not say, and in a
    #: simulation. ``duration - cpu_wait`` is the step's time on a core (the waits of torch's other threads, if
    #: it has any, are not counted).
    cpu_wait: float | None = None
    #: Seconds the engine's loop spent, between the previous step's end and this step's start, on its own work
    #: (sending the previous step's outputs, taking in new requests) rather than waiting for any: what a step
    #: costs beyond its record. Measured by a disaggregated worker, whose queued requests wait in its socket, not in
    #: the scheduler; None elsewhere.
    overhead_before: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def work(self) -> StepWork:
        """What the step computed, as a step-time model reads it."""
        return StepWork.of(tuple(zip(self.prefill_chunk_sizes, self.prefill_chunk_contexts, strict=True)),
                           self.num_decode_tokens,
                           self.num_context_tokens - sum(self.prefill_chunk_contexts))


@dataclass(frozen=True)
class StepWork:
    """The work of one step in the numbers a step-time model needs, the same whether the step ran
    (:attr:`StepStats.work`) or is about to run in a simulator (:meth:`from_entries`).

    A chunk of ``n`` prompt tokens whose request has ``e`` tokens in the cache after it attends to
    ``n·e - n(n-1)/2`` (query, key) pairs; a decode row at context ``c`` to ``c``.
    """

    #: Prompt tokens computed, in how many chunks (rows), and the (query, key) pairs they attended to.
    prefill_tokens: int = 0
    prefill_rows: int = 0
    prefill_pairs: int = 0
    #: Decode rows (one token each) and the keys they attended to, summed.
    decode_rows: int = 0
    decode_context: int = 0

    @classmethod
    def of(cls, chunks: tuple[tuple[int, int], ...], decode_rows: int, decode_context: int) -> StepWork:
        """From ``(size, context after)`` per prefill chunk and the decode rows' count and summed context."""
        return cls(sum(n for n, _ in chunks), len(chunks), sum(n * e - n * (n - 1) // 2 for n, e in chunks),
                   decode_rows, decode_context)

    @classmethod
    def from_entries(cls, entries: list) -> StepWork:
        """From a scheduled batch's ``(request, tokens)`` entries, before the step commits them."""
        chunks, rows, context = [], 0, 0
        for request, n in entries:
            end = request.num_computed_tokens + n
            # (Request.is_decode, inline: once per row of every simulated step)
            if n == 1 and end == len(request.all_token_ids) > request.num_prompt_tokens:
                rows, context = rows + 1, context + end
            else:
                chunks.append((n, end))
        return cls.of(tuple(chunks), rows, context)

    @property
    def num_tokens(self) -> int:
        """Tokens computed."""
        return self.prefill_tokens + self.decode_rows

    @property
    def num_rows(self) -> int:
        """Sequences in the step (each samples at most one token)."""
        return self.prefill_rows + self.decode_rows


@dataclass
class RequestCounters:
    """Counters a front end keeps over every request it served (what a metrics endpoint exports)."""

    #: Prompt tokens of the requests received.
    prompt_tokens: int = 0
    #: Output tokens delivered.
    generation_tokens: int = 0
    #: Requests finished, by finish reason (``"stop"``, ``"length"``, ``"abort"``).
    finished: dict[str, int] = field(default_factory=dict)
