"""Prometheus metrics under vLLM's names, with a ``model_name`` label, so dashboards built for vLLM read minipd.

Two sources, each the truth for what it counts:

- the engine: its front end's counters (prompt and generation tokens, finished requests by reason) and
  each step's record (requests running and waiting, KV blocks in use, prefix-cache lookups), read when
  ``/metrics`` is scraped; a disaggregated engine sums its workers' latest records;
- per request, when it ends in the engine (whether or not its client is still reading), its queueing time,
  time to first token, inter-token latencies and end-to-end latency, from the request's own timestamps: for
  the requests that ran to their end (an aborted one's latencies describe no finished request).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minipd.engine.stats import StepStats
from minipd.outputs import RequestMetrics

#: Bucket bounds (seconds) as vLLM has them, so histograms compare across the two.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class EngineCollector(Collector):
    """Reads an engine's counters and its latest step records at scrape time."""

    def __init__(self, llm: Any, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name
        self._latest: dict[str, StepStats] = {}  # worker ("" when colocated) -> its last step's record
        self._lock = threading.Lock()
        llm.engine.core.step_callbacks.append(self._on_step)

    def close(self) -> None:
        """Stop listening to the engine's steps (the engine may outlive this server)."""
        callbacks = self.llm.engine.core.step_callbacks
        if self._on_step in callbacks:
            callbacks.remove(self._on_step)

    def _on_step(self, stats: StepStats) -> None:  # (the engine's owner thread)
        with self._lock:
            self._latest[stats.worker] = stats

    def latest(self) -> list[StepStats]:
        """Each worker's last step record ("" names a colocated engine's)."""
        with self._lock:
            return list(self._latest.values())

    def load(self, latest: list[StepStats] | None = None) -> tuple[int, int, float]:
        """(requests running, requests waiting, share of KV blocks in use) after the engine's last step (each
        worker's, summed; ``latest`` when already read). When the engine is idle no request runs, waits or
        holds blocks, whatever the last step recorded (requests aborted since then gave theirs back)."""
        latest = self.latest() if latest is None else latest
        if not self.llm.engine.has_unfinished_requests():
            return 0, 0, 0.0
        running = sum(s.num_running for s in latest)
        waiting = sum(s.num_waiting + s.num_waiting_for_kv for s in latest)
        used, total = sum(s.kv_blocks_used for s in latest), sum(s.kv_blocks_used + s.kv_blocks_free for s in latest)
        return running, waiting, used / total if total else 0.0

    def collect(self) -> Iterator[Any]:
        label = [self.model_name]
        latest = self.latest()
        counters = self.llm.engine.processor.counters
        finished = _copy(counters.finished)
        running, waiting, kv_usage = self.load(latest)
        families = [
            ("vllm:num_requests_running", "Requests in the engine's running batch.", running, GaugeMetricFamily),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled (or for their K/V).", waiting,
             GaugeMetricFamily),
            ("vllm:kv_cache_usage_perc", "Share of KV blocks held by requests (1 = full).", kv_usage,
             GaugeMetricFamily),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             sum(s.prefix_queried_tokens for s in latest), CounterMetricFamily),
            ("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served.",
             sum(s.prefix_hit_tokens for s in latest), CounterMetricFamily),
            ("vllm:prompt_tokens", "Prompt tokens of the requests received.", counters.prompt_tokens,
             CounterMetricFamily),
            ("vllm:generation_tokens", "Output tokens generated.", counters.generation_tokens, CounterMetricFamily),
        ]
        for name, doc, value, kind in families:
            family = kind(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        success = CounterMetricFamily("vllm:request_success", "Requests finished, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "abort", *finished}):
            success.add_metric([self.model_name, reason], finished.get(reason, 0))
        yield success


def _copy(table: dict[str, int]) -> dict[str, int]:
    """A copy of a dict the engine's thread may grow meanwhile (a new key mid-copy: try again)."""
    for _ in range(10):
        try:
            return dict(table)
        except RuntimeError:
            continue
    return {}


class ServerMetrics:
    """The registry ``/metrics`` serves: the engine's collector and the per-request latency histograms."""

    def __init__(self, llm: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        #: The engine's side: counters, and the load after its last step.
        self.engine = EngineCollector(llm, model_name)
        self.registry.register(self.engine)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(model_name)

        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    REQUEST_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between successive output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             REQUEST_BUCKETS)
        self._processor = llm.engine.processor
        self._processor.finished_callbacks.append(self._on_finished)

    def close(self) -> None:
        """Stop listening to the engine (the engine may outlive this server)."""
        self.engine.close()
        if self._on_finished in self._processor.finished_callbacks:
            self._processor.finished_callbacks.remove(self._on_finished)

    def _on_finished(self, metrics: RequestMetrics, finish_reason: str) -> None:  # (the engine's owner thread)
        if finish_reason != "abort":
            self.observe(metrics)

    def observe(self, metrics: RequestMetrics) -> None:
        """Record a finished request's latencies (those it has: an aborted one may have no token)."""
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
        ttft = metrics.ttft
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        if metrics.finish_time is not None:
            self.e2e.observe(metrics.finish_time - metrics.arrival_time)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


__all__ = ["EngineCollector", "ServerMetrics"]
