"""A GPU step-time model for simulators: a roofline from datasheet numbers, O(1) per step, with tensor parallelism.

:class:`RooflineStepTime` answers "how long does this step take?" for a :class:`~minipd.engine.stats.StepWork`
in a few microseconds, where :func:`minipd.sim.costs.step_cost` (which walks every chunk and layer) takes
about a millisecond. It gets there by counting the same things as :mod:`minipd.sim.costs` with that module's
own functions, once, at construction: FLOPs and bytes per token, per (query, key) pair, per sampled row and
per cached key. A step is then a handful of multiply-adds on the five numbers of its ``StepWork``.

The time of a step is the roofline's ``max(compute, memory)`` at stated efficiencies, plus a fixed per-step
overhead, plus, with tensor parallelism, the all-reduces between the devices:

    step_time = max(flops / (peak · compute_efficiency), bytes / (bandwidth · memory_efficiency))
                + step_overhead_s + all-reduce time

:class:`Link` describes an interconnect (NVLink, PCIe, InfiniBand), for the all-reduces here and for the
K/V transfers between instances a cluster simulator makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minipd.config import ModelConfig
from minipd.sim.costs import (
    A100_80GB,
    MODEL_PRESETS,
    DeviceSpec,
    _activation_elements,
    _attention_flops_per_key,
    _expert_params,
    _kv_elements_per_layer,
    _moe_layer_count,
    count_parameters,
    matmul_weights_per_token,
)

if TYPE_CHECKING:
    from minipd.engine.stats import StepWork


@dataclass(frozen=True)
class Link:
    """A link between devices: its bandwidth in bytes/s in each direction, and the fixed latency of one
    transfer or collective on it (launch, synchronisation, the wire)."""

    name: str
    bandwidth: float
    latency_s: float

    def transfer_time(self, num_bytes: float) -> float:
        """Seconds to send ``num_bytes`` one way: the latency plus the bytes at the link's bandwidth."""
        return self.latency_s + num_bytes / self.bandwidth

    def all_reduce_time(self, num_bytes: float, devices: int) -> float:
        """Seconds of one ring all-reduce of ``num_bytes`` (each device's buffer) among ``devices``.

        A ring sends ``2 (n − 1) / n`` of the buffer over each device's link (a reduce-scatter, then an
        all-gather); 0 on one device.
        """
        if devices <= 1:
            return 0.0
        return self.latency_s + 2 * (devices - 1) / devices * num_bytes / self.bandwidth


#: NVLink 4 (H100/H200 SXM): 900 GB/s per GPU both directions together, 450 GB/s each way (NVIDIA H100
#: datasheet). 5 µs per collective: the order of a small all-reduce within an NVLink node (NCCL's
#: small-message latency is around 10 µs, the one-shot all-reduce kernels inference engines use a few µs).
NVLINK4 = Link("NVLink 4", 450e9, 5e-6)
#: NVLink 3 (A100 SXM): 600 GB/s per GPU both directions together, 300 GB/s each way (NVIDIA A100
#: datasheet); the same latency as :data:`NVLINK4`.
NVLINK3 = Link("NVLink 3", 300e9, 5e-6)
#: PCIe 5.0 x16: 64 GB/s each way before encoding overhead (PCI-SIG's 32 GT/s per lane × 16 lanes).
#: 10 µs: a transfer or collective through the PCIe switch or host, a few times NVLink's.
PCIE5_X16 = Link("PCIe 5 x16", 64e9, 10e-6)
#: One 400 Gb/s InfiniBand NDR or RoCE port per GPU: 50 GB/s each way. 10 µs: an RDMA transfer between nodes
#: end to end (the switch hops are ~1 µs; posting, completion and the software around them dominate).
IB_400G = Link("400G InfiniBand/RoCE", 50e9, 10e-6)

#: Defaults, and why (see :class:`RooflineStepTime`).
DEFAULT_COMPUTE_EFFICIENCY = 0.6
DEFAULT_MEMORY_EFFICIENCY = 0.8
DEFAULT_STEP_OVERHEAD_S = 1e-3
#: The link between the GPUs of one instance when none is given: the device's own NVLink (NVLink 4 unless
#: listed here by device name).
DEFAULT_LINKS: dict[str, Link] = {A100_80GB.name: NVLINK3}


class RooflineStepTime:
    """Seconds per engine step on ``tp`` devices of ``device``, from ``config``'s shape and the datasheet.

    Counts (at construction, with :mod:`minipd.sim.costs`'s functions, so with ``tp=1``, both efficiencies
    1 and no overhead it agrees with :func:`~minipd.sim.costs.step_cost`'s ``time_on(device)``, but for the
    approximations below):

    - **FLOPs**: ``2 × matmul weights`` per token, the attention's ``q·kᵀ`` and ``weights·v`` per (query, key)
      pair and layer, and the LM head per sampled row (one per prefill chunk and per decode row).
    - **Weights**, read once per step: the layers, the norms and the LM head matrix. For a mixture of experts,
      the experts a step touches: with top-``k`` routing over ``E`` experts and ``T`` tokens, the expected number
      of distinct experts per layer, ``E · (1 − (1 − k/E)^T)``, which assumes each token picks its ``k`` experts
      uniformly and independently of the other tokens. (``step_cost`` uses the upper bound ``min(E, T·k)``;
      the two meet when ``T·k`` is large. Real routing is skewed and correlated across tokens, so fewer
      distinct experts than this may be touched.)
    - **K/V read**: each decode row reads its context (``decode_context`` in all), each prefill chunk the
      keys up to its end, once per layer. ``StepWork`` keeps the chunks' (query, key) pairs and sizes, not
      their ends, so the ends' sum is recovered as if the chunks were the same size:
      ``rows · pairs / tokens + (tokens − rows) / 2``, exact for one chunk or equal chunks, close otherwise.
      **Full attention only**: sliding-window layers are costed as if they saw the whole context (an upper
      bound; none of the presets slides).
    - **K/V written**: every new token's, once per layer. **Activations**: as ``step_cost``, per token and per
      sampled row.

    **Tensor parallelism** (``tp`` > 1): FLOPs, weights and activations are split evenly over the ``tp``
    devices (the LM head and embedding vocabulary-parallel; the norms' replication is left out). K/V is
    split by KV head while ``num_key_value_heads ≥ tp``; beyond that each device keeps one KV head, replicated
    ``tp / num_key_value_heads`` times, and MLA's latent (one per token, shared by all heads) is replicated on
    every device. Each layer adds two all-reduces (after attention and after the MLP) of
    ``num_tokens × hidden × dtype_bytes``, each a ring on ``interconnect`` (default: the device's NVLink,
    :data:`NVLINK3` for an A100 and :data:`NVLINK4` otherwise), added to the step, not overlapped with it.

    **Efficiencies** (defaults, with the reason):

    - ``compute_efficiency = 0.6``: large BF16 GEMMs reach 0.6–0.8 of dense peak on A100/H100, and a whole
      step does worse: the FLOPs counted here are matmuls only, while norms, RoPE, softmax, activations and
      sampling also take time, and attention kernels run below the GEMMs' rate.
    - ``memory_efficiency = 0.8``: streaming kernels (and well-tuned decode GEMVs over the weights) reach
      80–90% of HBM peak; paged K/V gathers somewhat less.
    - ``step_overhead_s = 1 ms``: what a step costs besides its kernels in a well-tuned engine that replays
      CUDA graphs: scheduling, building the batch's inputs, sampling and returning tokens, not overlapped with
      the GPU in a synchronous engine loop such as minipd's.

    A step with no tokens takes 0 seconds.
    """

    def __init__(self, config: ModelConfig, device: DeviceSpec, tp: int = 1, dtype_bytes: int = 2,
                 kv_dtype_bytes: int | None = None, compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
                 memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY,
                 step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S, interconnect: Link | None = None) -> None:
        if tp < 1:
            raise ValueError(f"tp must be at least 1, got {tp}")
        if not (0 < compute_efficiency <= 1 and 0 < memory_efficiency <= 1):
            raise ValueError(f"efficiencies must be in (0, 1], got compute {compute_efficiency}, "
                             f"memory {memory_efficiency}")
        if step_overhead_s < 0 or dtype_bytes <= 0 or (kv_dtype_bytes is not None and kv_dtype_bytes <= 0):
            raise ValueError("step_overhead_s must be >= 0 and the dtype sizes positive")
        self.config, self.device, self.tp = config, device, tp
        self.dtype_bytes = dtype_bytes
        self.kv_dtype_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        self.compute_efficiency, self.memory_efficiency = compute_efficiency, memory_efficiency
        self.step_overhead_s = step_overhead_s
        self.interconnect = interconnect if interconnect is not None else DEFAULT_LINKS.get(device.name, NVLINK4)
        self.name = next((name for name, preset in MODEL_PRESETS.items() if preset == config), None) or \
            f"{config.model_type} ({count_parameters(config).total / 1e9:.1f}B)"

        layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
        # How many ways the K/V cache is split: by KV head, at most one head per device; MLA's latent not at all.
        self.kv_split = 1 if config.is_mla else min(tp, config.num_key_value_heads)
        params = count_parameters(config)

        # FLOPs per device: per token (the layers' linear maps), per (query, key) pair, per sampled row.
        self._flops_token = 2 * matmul_weights_per_token(config) / tp
        self._flops_pair = _attention_flops_per_key(config) * layers / tp  # every layer full attention
        self._flops_row = 2 * hidden * vocab / tp

        # Bytes per device. Weights: all but the routed experts, and per expected expert read per layer.
        moe_layers = _moe_layer_count(config) if config.is_moe else 0
        expert_elems = moe_layers * _expert_params(config)
        self._weight_fixed = dtype_bytes * (params.non_embedding - config.num_experts * expert_elems
                                            + vocab * hidden) / tp
        self._weight_expert = dtype_bytes * expert_elems / tp
        self._experts, k = config.num_experts, config.num_experts_per_tok
        self._log_miss = math.log1p(-k / config.num_experts) if config.is_moe and k < config.num_experts else None
        kv_token = _kv_elements_per_layer(config) * layers * self.kv_dtype_bytes  # all layers, one token
        self._kv_token = kv_token / self.kv_split
        act_token, act_row = _activation_elements(config)
        self._bytes_token = (self._kv_token  # the K/V written
                             + dtype_bytes * act_token / tp)
        self._bytes_row = dtype_bytes * act_row / tp

        # Rates, and the all-reduces: two per layer, fixed latency plus bytes per token.
        self._flop_rate = device.peak_flops * compute_efficiency
        self._byte_rate = device.mem_bandwidth * memory_efficiency
        link = self.interconnect
        if tp > 1:
            self._ar_fixed = 2 * layers * link.latency_s
            self._ar_token = 2 * layers * 2 * (tp - 1) / tp * hidden * dtype_bytes / link.bandwidth
        else:
            self._ar_fixed = self._ar_token = 0.0
        self._weight_bytes_stored = dtype_bytes * params.total / tp

    # --- the step -------------------------------------------------------------------------------------

    def flops_and_bytes(self, work: StepWork) -> tuple[float, float]:
        """FLOPs one device computes in the step and bytes it moves (see the class docstring)."""
        prefill_tokens, prefill_rows = work.prefill_tokens, work.prefill_rows
        decode_rows = work.decode_rows
        tokens = prefill_tokens + decode_rows
        rows = prefill_rows + decode_rows
        pairs = work.prefill_pairs + work.decode_context
        flops = self._flops_token * tokens + self._flops_pair * pairs + self._flops_row * rows
        # The keys the prefill chunks read: the sum of their ends, as if they were of equal size.
        keys = work.decode_context
        if prefill_rows:
            keys += prefill_rows * work.prefill_pairs / prefill_tokens + (prefill_tokens - prefill_rows) / 2
        weights = self._weight_fixed
        if self._experts:
            if self._log_miss is None:  # every token uses every expert
                weights += self._weight_expert * self._experts
            else:
                weights += self._weight_expert * self._experts * -math.expm1(tokens * self._log_miss)
        moved = weights + self._kv_token * keys + self._bytes_token * tokens + self._bytes_row * rows
        return flops, moved

    def step_time(self, work: StepWork) -> float:
        """Seconds the step takes: the roofline at the stated efficiencies, the overhead, the all-reduces."""
        tokens = work.prefill_tokens + work.decode_rows
        if tokens == 0:
            return 0.0
        flops, moved = self.flops_and_bytes(work)
        compute, memory = flops / self._flop_rate, moved / self._byte_rate
        return (compute if compute > memory else memory) + self.step_overhead_s + self._ar_fixed \
            + self._ar_token * tokens

    def all_reduce_time(self, work: StepWork) -> float:
        """The part of :meth:`step_time` the tensor-parallel all-reduces take (0 with ``tp=1``)."""
        tokens = work.num_tokens
        return self._ar_fixed + self._ar_token * tokens if tokens else 0.0

    def bound(self, work: StepWork) -> str:
        """``"compute"`` or ``"memory"``: which roof sets the step's time (at the stated efficiencies)."""
        flops, moved = self.flops_and_bytes(work)
        return "compute" if flops / self._flop_rate >= moved / self._byte_rate else "memory"

    # --- memory ---------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K/V one token keeps on each device, over all layers."""
        return self._kv_token

    @property
    def weight_bytes_per_device(self) -> float:
        """Bytes of parameters each device stores: all of them (every expert), split evenly over ``tp``."""
        return self._weight_bytes_stored

    def kv_capacity_tokens(self, memory_bytes: float | None = None, reserve_fraction: float = 0.1) -> int:
        """Tokens of K/V an instance can keep: each device's ``memory_bytes`` (default ``device.memory_bytes``),
        less ``reserve_fraction`` of it (activations, CUDA graphs, the allocator's slack), less its weights,
        divided by the K/V one token keeps on it. 0 when the weights do not fit."""
        memory = self.device.memory_bytes if memory_bytes is None else memory_bytes
        if memory <= 0:
            raise ValueError(f"need the device's memory in bytes; {self.device.name} gives {memory}")
        if not 0 <= reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
        free = memory * (1 - reserve_fraction) - self._weight_bytes_stored
        return max(0, int(free // self._kv_token))

    def describe(self) -> str:
        """One line: model, device, tensor parallelism, efficiencies, overhead."""
        link = f" over {self.interconnect.name}" if self.tp > 1 else ""
        return (f"{self.name} on {self.tp}× {self.device.name}{link}: compute {self.compute_efficiency:.0%} and "
                f"memory {self.memory_efficiency:.0%} of peak, {self.step_overhead_s * 1e3:g} ms overhead per step")

    def __repr__(self) -> str:
        return f"RooflineStepTime({self.describe()})"


__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY",
    "DEFAULT_LINKS",
    "DEFAULT_MEMORY_EFFICIENCY",
    "DEFAULT_STEP_OVERHEAD_S",
    "IB_400G",
    "NVLINK3",
    "NVLINK4",
    "PCIE5_X16",
    "Link",
    "RooflineStepTime",
]
