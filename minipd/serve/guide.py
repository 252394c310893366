"""Choosing a deployment: the source article's selection guide, with its thresholds computed rather than asserted.

The guide says: short text, one dense instance (no network cost); long text, a prefill/decode split with a
compressed KV cache (memory); very large models, a mixture of experts sharded over devices. Here each rule
is a number:

- **Does the model fit one device?** Its weights (:func:`minipd.sim.costs.count_parameters`) against the
  device's memory with room left for the KV cache (``weights_share``). If not: shard it; a MoE model is
  sharded by experts (chapter 07), a dense one by tensor parallelism.
- **Does the KV cache of the requests in flight fit?** Little's law gives the requests in flight (rate
  × time each spends), :func:`~minipd.sim.costs.kv_bytes_per_token` their cache. Long prompts (at least
  ``long_prompt`` tokens), or a cache that overflows the memory left, call for the split (prefills no
  longer stall decodes: chapter 05) and an int8 cache (a quarter of fp32's bytes, half of fp16's:
  chapter 06).
- Otherwise one dense instance.

The predicted goodput comes from a measured latency curve (:class:`LatencyCurve`, from ``loadgen`` runs at
several rates): the highest rate measured whose P90 TTFT and P90 TPOT met the SLOs, interpolated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipd.sim.costs import count_parameters, kv_bytes_per_token, preset


@dataclass(frozen=True)
class LatencyCurve:
    """Latency percentiles measured at several offered rates (requests/s, increasing)."""

    rates: tuple[float, ...]
    p90_ttft_ms: tuple[float, ...]
    p90_tpot_ms: tuple[float, ...]

    def goodput(self, ttft_slo_ms: float, tpot_slo_ms: float) -> float:
        """The highest rate whose P90s meet both SLOs, interpolated linearly between measured rates
        (0 if even the lowest misses; the highest measured if none misses: a lower bound then)."""
        # At each rate, the worse of the two P90s as a share of its SLO: met while <= 1.
        excess = [max(ttft / ttft_slo_ms, tpot / tpot_slo_ms) for ttft, tpot in zip(self.p90_ttft_ms,
                                                                                     self.p90_tpot_ms, strict=True)]
        if not excess or excess[0] > 1:
            return 0.0
        for i in range(1, len(self.rates)):
            if excess[i] > 1:  # crossed between rates i - 1 and i: interpolate where it reaches 1
                lo, hi = excess[i - 1], excess[i]
                return self.rates[i - 1] + (1.0 - lo) / (hi - lo) * (self.rates[i] - self.rates[i - 1])
        return self.rates[-1]


@dataclass(frozen=True)
class Recommendation:
    """A deployment and why."""

    deployment: str
    reasons: list[str] = field(default_factory=list)
    #: Requests/s at the SLOs, when a measured curve was given (for one instance of the measured engine).
    predicted_goodput: float | None = None
    #: The numbers behind it, in GB: the weights, the KV cache of the requests in flight (0 when the weights
    #: alone decided), and one device's memory.
    weights_gb: float = 0.0
    kv_gb: float = 0.0
    device_gb: float = 0.0


def recommend(model: str, prompt_tokens: int, output_tokens: int, rate: float, ttft_slo_ms: float = 500.0,
              tpot_slo_ms: float = 50.0, device_memory_gb: float = 80.0, weights_share: float = 0.8,
              long_prompt: int = 4096, curve: LatencyCurve | None = None) -> Recommendation:
    """The article's guide for ``model`` (a :func:`minipd.sim.costs.preset` name, bf16 weights and cache) serving
    requests of ``prompt_tokens`` in and ``output_tokens`` out at ``rate`` requests/s on devices of
    ``device_memory_gb``; ``curve`` (measured on the engine that would serve) adds a predicted goodput."""
    config = preset(model)
    params = count_parameters(config)
    weights_gb = params.total * 2 / 1e9
    memory = device_memory_gb * 1e9
    reasons = [f"{model}: {params.total / 1e9:.1f}B parameters ({params.active / 1e9:.1f}B active per token), "
               f"{weights_gb:.0f} GB of bf16 weights on a {device_memory_gb:.0f} GB device"]
    goodput = None if curve is None else curve.goodput(ttft_slo_ms, tpot_slo_ms)
    if weights_gb > weights_share * device_memory_gb:
        devices = int(-(-weights_gb // (weights_share * device_memory_gb)))
        if params.active < 0.5 * params.total:
            reasons.append(f"the weights need {devices}+ devices; each token uses {params.active / params.total:.0%} "
                           "of them, so shard the experts (expert parallelism) and keep attention replicated")
            return Recommendation("MoE + expert sharding", reasons, goodput, weights_gb, 0.0, device_memory_gb)
        reasons.append(f"the weights need {devices}+ devices and every token uses all of them: tensor parallelism")
        return Recommendation("tensor parallel (dense, sharded)", reasons, goodput, weights_gb, 0.0, device_memory_gb)
    kv_token = kv_bytes_per_token(config, 2)
    seconds_each = (ttft_slo_ms + output_tokens * tpot_slo_ms) / 1000  # at the SLOs: an upper bound in practice
    in_flight = rate * seconds_each  # Little's law
    kv_needed = in_flight * (prompt_tokens + output_tokens) * kv_token
    kv_room = memory - weights_gb * 1e9
    reasons.append(f"{in_flight:.0f} requests in flight (Little's law: {rate:g}/s × {seconds_each:.2f} s) hold "
                   f"{kv_needed / 1e9:.1f} GB of KV cache ({kv_token / 1024:.0f} KiB/token) against "
                   f"{kv_room / 1e9:.0f} GB left beside the weights")
    if prompt_tokens >= long_prompt or kv_needed > kv_room:
        why = "long prompts stall every decode step they share" if prompt_tokens >= long_prompt else \
            "the cache of the requests in flight does not fit"
        reasons.append(f"{why}: split prefill and decode, and keep K/V in int8 (half of bf16's bytes: "
                       f"{kv_needed / 2e9:.1f} GB)")
        return Recommendation("PD split + KV compression", reasons, goodput, weights_gb, kv_needed / 1e9,
                              device_memory_gb)
    reasons.append("short requests that fit: one dense instance, no KV transfer over the network")
    return Recommendation("one dense instance", reasons, goodput, weights_gb, kv_needed / 1e9, device_memory_gb)


__all__ = ["LatencyCurve", "Recommendation", "recommend"]
