"""An analytic cost model of one engine step: parameters, FLOPs, bytes moved, arithmetic intensity.

Everything here is counted from a :class:`~minipd.config.ModelConfig` alone, with no model loaded,
so the same functions describe tiny-py on a laptop and an 8B model on an H100.

Conventions (each function's docstring repeats the ones it uses):

- **FLOPs** count the matrix products only, at 2 FLOPs per multiply-add: the linear layers (q/k/v/o
  projections, the MLP or the routed experts and their router, the LM head) and the two products
  of attention (``q·kᵀ`` and ``weights·v``). Norms, RoPE, SiLU, softmax, biases and residual adds
  are a rounding error next to them and are left out.
- **Bytes** are what one step must move between memory and the chip at the least, each byte once:
  the weights it multiplies by, the K/V it reads from the cache and writes into it, and (roughly)
  the activations going in and out of each matrix product.
- The **LM head** runs only on the rows that sample a token, one per sequence, as minipd's model
  runner does; a prefill of ``P`` tokens pays for it once, not ``P`` times.
- A sequence's **context** is how many keys its newest query attends to, the new token included: a
  decode step of a sequence with ``n`` tokens so far (prompt and output) has context ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minipd.config import ModelConfig

# --- parameters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model by part, as HF transformers builds it (a tied LM head counted once)."""

    #: The token embedding table, ``vocab × hidden``, and a learned position table where the family has
    #: one (OPT: ``(max_position_embeddings + 2) × hidden``).
    embedding: int
    #: All layers: q/k/v/o weights, q/k/v biases where the family has them, per-head q/k norms.
    attention: int
    #: All layers: the SwiGLU MLP (OPT: fc1 and fc2 with their biases), or every expert plus the router.
    mlp: int
    #: All layers' two norms plus the final norm (RMSNorm weights; OPT's LayerNorms, weight and bias).
    norms: int
    #: The LM head matrix; 0 when it is tied to the embedding.
    lm_head: int
    #: MLP parameters one token uses: the same as ``mlp`` for a dense model, its top-k experts and
    #: the router for a mixture of experts.
    mlp_active: int

    @property
    def total(self) -> int:
        """Every parameter, a tied LM head once (what ``sum(p.numel() for p in model.parameters())`` gives)."""
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head

    @property
    def non_embedding(self) -> int:
        """Parameters of the layers and norms: the total without the embedding and the LM head."""
        return self.attention + self.mlp + self.norms

    @property
    def active(self) -> int:
        """Parameters one token uses: the total with only the experts a token is routed to."""
        return self.total - self.mlp + self.mlp_active


def _attention_weights_per_layer(config: ModelConfig) -> int:
    """Weights of q, k, v and o in one layer (no biases, no norms).

    Multi-head latent attention (DeepSeek-V3): the query projection (directly, or down to ``q_lora_rank``
    and back up), the down-projection to the latent and shared rope key (``kv_a``), the up-projection of
    the latent to every head's no-rope key and value (``kv_b``), and o.
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    if config.is_mla:
        q_out = heads * config.head_dim
        q = hidden * q_out if config.q_lora_rank is None else config.q_lora_rank * (hidden + q_out)
        kv_a = hidden * config.kv_latent_dim
        kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        return q + kv_a + kv_b + heads * config.v_head_dim * hidden
    q = heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return hidden * (q + 2 * kv) + q * hidden


def _attention_extras_per_layer(config: ModelConfig) -> int:
    """Biases and norm weights of one layer's attention (see :func:`count_parameters`)."""
    if config.is_mla:
        # The latent's RMSNorm, the query bottleneck's; with attention_bias, biases on q_a, kv_a and o.
        extras = config.kv_lora_rank + (config.q_lora_rank or 0)
        if config.attention_bias:
            extras += (config.q_lora_rank or 0) + config.kv_latent_dim + config.hidden_size
        return extras
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    extras = 0
    if config.attention_bias:
        extras += q + 2 * kv + (config.hidden_size if config.o_proj_bias else 0)
    if config.qk_norm:
        extras += 2 * config.head_dim
    return extras


def _mlp_matrices(config: ModelConfig, width: int) -> int:
    """Weights of one MLP of hidden width ``width``: gate, up and down (SwiGLU), or OPT's fc1 and fc2."""
    return (3 if config.gated_mlp else 2) * config.hidden_size * width


def _expert_params(config: ModelConfig) -> int:
    """One routed expert: gate, up and down, ``3 × hidden × expert width``."""
    return _mlp_matrices(config, config.expert_intermediate_size)


def _mlp_params(config: ModelConfig, layer: int) -> tuple[int, int]:
    """Layer ``layer``'s MLP matrix weights, and those one token uses: all of a dense MLP; for a mixture,
    the router, the shared expert and its gate (Qwen2-MoE) and ``num_experts_per_tok`` routed experts.

    Biases (OPT's fc1 and fc2) are not weights a token is multiplied by; see :func:`_mlp_extras_per_layer`.
    """
    hidden = config.hidden_size
    if not config.layer_is_moe(layer):
        dense = _mlp_matrices(config, config.intermediate_size)
        return dense, dense
    always = hidden * config.num_experts  # the router
    if config.shared_expert_intermediate_size:
        always += _mlp_matrices(config, config.shared_expert_intermediate_size)  # the shared expert(s)
        if config.shared_expert_gated:
            always += hidden  # and Qwen2-MoE's sigmoid gate
    return (config.num_experts * _expert_params(config) + always,
            config.num_experts_per_tok * _expert_params(config) + always)


def _mlp_extras_per_layer(config: ModelConfig, layer: int) -> int:
    """Biases of layer ``layer``'s MLP: fc1's and fc2's in OPT (no family with biases there has experts)."""
    if not config.mlp_bias or config.layer_is_moe(layer):
        return 0
    return config.intermediate_size + config.hidden_size


def _mlp_io(config: ModelConfig, layer: int) -> int:
    """Activation elements one token reads and writes in layer ``layer``'s MLP."""
    hidden = config.hidden_size

    def swiglu(width: int) -> int:  # gate_up in/out, down in/out (OPT: fc1 in/out, fc2 in/out)
        return hidden + (2 if config.gated_mlp else 1) * width + width + hidden

    if not config.layer_is_moe(layer):
        return swiglu(config.intermediate_size)
    io = config.num_experts_per_tok * swiglu(config.expert_intermediate_size) + hidden + config.num_experts
    if config.shared_expert_intermediate_size:
        io += swiglu(config.shared_expert_intermediate_size) + (hidden + 1 if config.shared_expert_gated else 0)
    return io


def count_parameters(config: ModelConfig) -> ParamCounts:
    """Parameters of ``config``'s model by part, as HF transformers builds it.

    Biases follow transformers: with ``config.attention_bias``, Qwen2 and Qwen2-MoE have q/k/v biases
    and the other families (a Llama or Qwen3 config that sets ``attention_bias``) q/k/v and o biases.
    Qwen3 adds a ``head_dim`` RMSNorm weight for q and one for k per layer. A router is
    ``hidden × num_experts``, no bias; Qwen2-MoE's shared expert is a SwiGLU and a ``hidden × 1`` gate;
    Qwen-MoE layers listed as dense have a plain MLP of ``intermediate_size``.

    DeepSeek-V3: multi-head latent attention (see :func:`_attention_weights_per_layer`) with an RMSNorm
    on the latent and one on the query bottleneck, counted with the attention; ``n_shared_experts``
    ungated shared experts; the first ``first_k_dense_replace`` layers dense. The router's
    ``e_score_correction_bias`` is a buffer in HF, not a parameter, and is not counted.

    OPT (``gated_mlp`` False): q/k/v/o with biases, fc1 and fc2 with biases, LayerNorms with a weight and
    a bias, and a learned position table of ``max_position_embeddings + 2`` rows counted with the embedding.
    """
    layers = config.num_hidden_layers
    attention = _attention_weights_per_layer(config) + _attention_extras_per_layer(config)
    mlps = [_mlp_params(config, i) for i in range(layers)]
    mlp_biases = sum(_mlp_extras_per_layer(config, i) for i in range(layers))
    tokens = config.vocab_size * config.hidden_size
    return ParamCounts(
        embedding=tokens + config.learned_positions * config.hidden_size,
        attention=layers * attention,
        mlp=sum(total for total, _ in mlps) + mlp_biases,
        norms=(2 * layers + 1) * config.hidden_size * (2 if config.norm_bias else 1),
        lm_head=0 if config.tie_word_embeddings else tokens,
        mlp_active=sum(active for _, active in mlps) + mlp_biases,
    )


def matmul_weights_per_token(config: ModelConfig) -> int:
    """Weights one token is multiplied by on its way through the layers (LM head not included).

    The q/k/v/o projections and the MLP of every layer; for a mixture of experts, the router and
    the ``num_experts_per_tok`` experts the token is routed to. Each of these weights costs the
    token one multiply-add, i.e. 2 FLOPs.
    """
    layers = range(config.num_hidden_layers)
    return sum(_attention_weights_per_layer(config) + _mlp_params(config, i)[1] for i in layers)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token keeps in the cache, over all layers: ``2 · layers · kv_heads · head_dim · bytes``.

    K and V (the 2) for each KV head, not each query head: grouped-query attention shrinks the cache
    by ``num_attention_heads / num_key_value_heads``. ``dtype_bytes`` is 2 for bf16/fp16, 4 for
    fp32, 1 for an int8/fp8 cache.

    Multi-head latent attention caches no per-head K or V at all, only each token's latent and its
    shared rope key: ``layers · (kv_lora_rank + qk_rope_head_dim) · bytes``.
    """
    return config.num_hidden_layers * _kv_elements_per_layer(config) * dtype_bytes


def mha_kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes per token the same attention would cache with a K and a V for every query head (plain MHA).

    ``layers · heads · (k head size + v head size) · bytes``: what grouped-query attention or MLA is
    compared against. For MLA a key head is ``qk_nope_head_dim + qk_rope_head_dim`` wide and a value
    head ``v_head_dim``, as the up-projected K and V are.
    """
    v_dim = config.v_head_dim if config.is_mla else config.head_dim
    return config.num_hidden_layers * config.num_attention_heads * (config.head_dim + v_dim) * dtype_bytes


def _kv_elements_per_layer(config: ModelConfig) -> int:
    """Elements one token caches in one layer: K and V of each KV head, or MLA's latent and rope key."""
    return config.kv_latent_dim if config.is_mla else 2 * config.num_key_value_heads * config.head_dim


def _attention_flops_per_key(config: ModelConfig) -> int:
    """FLOPs of one (query, visible key) pair in one layer: ``q·kᵀ`` and ``weights·v`` for every query head.

    MLA is counted in its absorbed form, the one a decode runs: each head's query is folded into the
    latent space, so it scores the ``kv_lora_rank + qk_rope_head_dim`` cached row and sums ``kv_lora_rank``
    latent values (the up-projections are in the linear FLOPs, once per token).
    """
    heads = config.num_attention_heads
    if config.is_mla:
        return 2 * heads * (config.kv_latent_dim + config.kv_lora_rank)
    return 4 * heads * config.head_dim


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved: above a device's ridge point a step is compute-bound, below it memory-bound."""
    return flops / bytes_moved


# --- one step -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one forward step, split by where they come from.

    Build with :func:`prefill_cost`, :func:`decode_cost` or :func:`step_cost`.
    """

    #: Tokens computed in the step (prompt tokens of a prefill; one per sequence in decode).
    num_tokens: int
    #: Sequences in the step; each samples one token, so each pays for one LM-head row.
    num_sequences: int
    #: The layers' linear maps: q/k/v/o and the MLP (routed experts and router for MoE).
    linear_flops: int
    #: ``q·kᵀ`` and ``weights·v``: ``4 · query_heads · head_dim`` per (query, visible key) per layer.
    attention_flops: int
    #: The LM head, ``2 · hidden · vocab`` per sampled row.
    lm_head_flops: int
    #: Every weight the step multiplies by, read once, and the norm weights: the non-embedding
    #: parameters plus the LM head matrix (only the routed experts of a mixture of experts).
    weight_bytes: int
    #: K and V of every visible cached position, read once per layer.
    kv_read_bytes: int
    #: K and V of the new tokens, written once.
    kv_write_bytes: int
    #: Inputs and outputs of each matrix product (elementwise work assumed fused) and the embedding
    #: rows looked up; a rough figure.
    activation_bytes: int

    @property
    def flops(self) -> int:
        """All matmul FLOPs of the step."""
        return self.linear_flops + self.attention_flops + self.lm_head_flops

    @property
    def bytes(self) -> int:
        """All bytes the step moves: weights, KV cache reads and writes, activations."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved."""
        return arithmetic_intensity(self.flops, self.bytes)

    def time_on(self, device: DeviceSpec) -> float:
        """Roofline lower bound on the step's seconds: whichever of compute and memory takes longer."""
        return max(self.flops / device.peak_flops, self.bytes / device.mem_bandwidth)

    def bound_on(self, device: DeviceSpec) -> str:
        """``"compute"`` or ``"memory"``: which limit sets :meth:`time_on`."""
        return "compute" if self.arithmetic_intensity >= device.ridge_point else "memory"


def _sum_min(first: int, last: int, cap: int | None) -> int:
    """``sum(min(p, cap) for p in range(first, last + 1))`` in closed form; ``cap=None`` means no cap."""
    if last < first:
        return 0
    if cap is None or last <= cap:
        return (first + last) * (last - first + 1) // 2
    if first > cap:
        return cap * (last - first + 1)
    return (first + cap) * (cap - first + 1) // 2 + cap * (last - cap)


def _windows(config: ModelConfig) -> tuple[int | None, ...]:
    return config.sliding_windows or (None,) * config.num_hidden_layers


def step_cost(config: ModelConfig, chunks: Sequence[tuple[int, int]], dtype_bytes: int = 2,
              kv_dtype_bytes: int | None = None) -> StepCost:
    """The cost of one step that computes, for each sequence, ``new`` tokens after ``cached`` ones.

    Args:
        config: the model's shape.
        chunks: one ``(cached, new)`` pair per sequence: ``(0, P)`` is the prefill of a P-token
            prompt, ``(n - 1, 1)`` a decode step at context ``n``, ``(c, k)`` a prefill chunk that
            continues a prompt whose first ``c`` tokens are already in the cache.
        dtype_bytes: bytes per weight and activation element (2 for bf16, 4 for fp32).
        kv_dtype_bytes: bytes per K/V element; ``dtype_bytes`` when None.

    The new token at position ``p`` (0-based) attends to ``min(p + 1, window)`` keys in each
    layer (``window`` from ``config.sliding_windows``; no cap on full-attention layers). Each
    sequence samples one token, so the LM head runs on ``len(chunks)`` rows. Weights are read once
    for the whole step, however many tokens share them; a mixture of experts reads at most
    ``min(num_experts, tokens · top_k)`` experts per layer (an upper bound: tokens may share experts).
    """
    if not chunks:
        raise ValueError("step_cost needs at least one (cached, new) chunk")
    for cached, new in chunks:
        if cached < 0 or new < 1:
            raise ValueError(f"each chunk needs cached >= 0 and new >= 1, got ({cached}, {new})")
    kv_dtype_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    tokens = sum(new for _, new in chunks)
    seqs = len(chunks)
    hidden, vocab = config.hidden_size, config.vocab_size
    windows = _windows(config)

    # FLOPs.
    linear_flops = 2 * tokens * matmul_weights_per_token(config)
    keys_seen = sum(_sum_min(cached + 1, cached + new, w) for w in windows for cached, new in chunks)
    attention_flops = _attention_flops_per_key(config) * keys_seen
    lm_head_flops = 2 * seqs * hidden * vocab

    # Weights: the layers and the final norm, and the LM head matrix (the embedding table when tied).
    # Embedding lookups touch only one row per token; they are counted with the activations.
    layer_params = count_parameters(config).non_embedding
    if config.is_moe:
        experts_read = min(config.num_experts, tokens * config.num_experts_per_tok)
        layer_params -= _moe_layer_count(config) * (config.num_experts - experts_read) * _expert_params(config)
    weight_bytes = dtype_bytes * (layer_params + vocab * hidden)

    # KV cache: each layer reads the union of the windows its new queries see, and writes the new K/V.
    kv_layer_token = _kv_elements_per_layer(config) * kv_dtype_bytes
    kv_read = 0
    for w in windows:
        for cached, new in chunks:
            end = cached + new
            start = 0 if w is None else max(0, cached - w + 1)
            kv_read += (end - start) * kv_layer_token
    kv_write = tokens * kv_layer_token * config.num_hidden_layers

    per_token, per_sequence = _activation_elements(config)
    activation_bytes = dtype_bytes * (tokens * per_token + seqs * per_sequence)

    return StepCost(num_tokens=tokens, num_sequences=seqs, linear_flops=linear_flops,
                    attention_flops=attention_flops, lm_head_flops=lm_head_flops, weight_bytes=weight_bytes,
                    kv_read_bytes=kv_read, kv_write_bytes=kv_write, activation_bytes=activation_bytes)


def _moe_layer_count(config: ModelConfig) -> int:
    """How many layers have the mixture of experts as their MLP."""
    return sum(config.layer_is_moe(i) for i in range(config.num_hidden_layers))


def _activation_elements(config: ModelConfig) -> tuple[int, int]:
    """Activation elements a step reads and writes per token, and per sampled row (see :func:`step_cost`).

    Per token and layer: qkv_proj in/out, attention q in / out, o_proj in/out, then the MLP (per routed
    expert: gate_up in/out and down in/out; plus the router's in/out); plus the embedding row (and learned
    position row) each token looks up. Per sampled row: the LM head's input and logits.
    """
    hidden, vocab = config.hidden_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    attention_io = (hidden + q_dim + 2 * kv_dim) + 2 * q_dim + (q_dim + hidden)
    if config.is_mla:
        # Projections in and out (the query bottleneck, q, the latent), the absorbed query and the
        # latent attention output per head, then o_proj's input and output.
        latent_q = config.num_attention_heads * config.kv_latent_dim
        attention_io = (2 * hidden + 2 * (config.q_lora_rank or 0) + q_dim + config.kv_latent_dim
                        + 2 * latent_q + config.num_attention_heads * config.v_head_dim + hidden)
    per_token = sum(attention_io + _mlp_io(config, i) for i in range(config.num_hidden_layers))
    lookups = hidden * (2 if config.learned_positions else 1)
    return per_token + lookups, hidden + vocab


def prefill_cost(config: ModelConfig, prompt_len: int, batch: int = 1, cached: int = 0, dtype_bytes: int = 2,
                 kv_dtype_bytes: int | None = None) -> StepCost:
    """One step that prefills ``batch`` prompts of ``prompt_len`` tokens each (after ``cached`` cached ones).

    See :func:`step_cost` for what is counted.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    return step_cost(config, [(cached, prompt_len)] * batch, dtype_bytes, kv_dtype_bytes)


def decode_cost(config: ModelConfig, batch: int, context: int | Sequence[int], dtype_bytes: int = 2,
                kv_dtype_bytes: int | None = None) -> StepCost:
    """One decode step of ``batch`` sequences: one new token each, attending to ``context`` keys.

    ``context`` is one length for all sequences or one per sequence, the new token included (a
    sequence of ``n`` tokens so far decodes at context ``n``). See :func:`step_cost`.
    """
    contexts = [context] * batch if isinstance(context, int) else list(context)
    if len(contexts) != batch:
        raise ValueError(f"got {len(contexts)} context lengths for a batch of {batch}")
    if batch < 1 or min(contexts) < 1:
        raise ValueError(f"batch and every context must be at least 1, got batch {batch}, contexts {contexts}")
    return step_cost(config, [(c - 1, 1) for c in contexts], dtype_bytes, kv_dtype_bytes)


# --- devices --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """What bounds a device on the roofline: peak matmul FLOP/s and memory bandwidth (bytes/s); and how
    much memory it has, for what fits in it (0 when unknown)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    #: Where the figures come from (a datasheet, or "measured").
    source: str = ""
    #: Device memory in bytes, as the datasheet states it (decimal GB); 0.0 when not given.
    memory_bytes: float = 0.0

    @property
    def ridge_point(self) -> float:
        """The arithmetic intensity (FLOP/byte) at which memory stops being the limit."""
        return self.peak_flops / self.mem_bandwidth

    def attainable_flops(self, intensity: float) -> float:
        """The roofline: ``min(peak, intensity · bandwidth)`` FLOP/s."""
        return min(self.peak_flops, intensity * self.mem_bandwidth)


#: NVIDIA A100 80GB SXM: 312 TFLOP/s dense BF16 tensor core (624 with 2:4 sparsity), 2,039 GB/s HBM2e,
#: 80 GB. Source: NVIDIA A100 Tensor Core GPU datasheet (the 80GB PCIe card has 1,935 GB/s).
A100_80GB = DeviceSpec("A100 80GB SXM", 312e12, 2.039e12, "NVIDIA A100 datasheet (dense BF16)", 80e9)
#: NVIDIA H100 SXM5: 989 TFLOP/s dense BF16 tensor core (1,979 with 2:4 sparsity), 3.35 TB/s HBM3, 80 GB.
#: Source: NVIDIA H100 Tensor Core GPU datasheet.
H100_SXM = DeviceSpec("H100 SXM", 989e12, 3.35e12, "NVIDIA H100 datasheet (dense BF16)", 80e9)
#: NVIDIA H200 SXM: the same compute as H100 SXM, 4.8 TB/s HBM3e, 141 GB. Source: NVIDIA H200 datasheet.
H200 = DeviceSpec("H200", 989e12, 4.8e12, "NVIDIA H200 datasheet (dense BF16)", 141e9)


# --- real model shapes ----------------------------------------------------------------------------

#: The shape fields of public ``config.json`` files on the Hugging Face hub (repository in each
#: comment), read with :meth:`ModelConfig.from_dict` like any checkpoint's config.
_PRESET_CONFIGS: dict[str, dict] = {
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json — 8,030,261,248 parameters
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    # huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json — 6,738,415,616 parameters
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json — 596,049,920 parameters
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, attention_bias=False, bos_token_id=151643,
                       eos_token_id=151645),
    # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json — 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False, attention_bias=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          bos_token_id=151643, eos_token_id=151645),
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json — 671B parameters, 37B active (not counting
    # the multi-token-prediction layer the checkpoint adds); multi-head latent attention, YaRN RoPE.
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
                        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                        tie_word_embeddings=False, attention_bias=False, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
                        moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc", bos_token_id=0,
                        eos_token_id=1),
    # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json — 46,702,792,704 parameters
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                         sliding_window=None, bos_token_id=1, eos_token_id=2),
    # huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json — 70,553,706,496 parameters
    "llama-3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    # huggingface.co/facebook/opt-13b/blob/main/config.json — 12,853,473,280 parameters. OPT is costed, not
    # run: a ReLU MLP of two matrices with biases, learned positions, LayerNorm; the LM head tied.
    "opt-13b": dict(model_type="opt", vocab_size=50272, hidden_size=5120, ffn_dim=20480, num_hidden_layers=40,
                    num_attention_heads=40, max_position_embeddings=2048, word_embed_proj_dim=5120,
                    activation_function="relu", do_layer_norm_before=True, enable_bias=True,
                    bos_token_id=2, eos_token_id=2),
    # huggingface.co/facebook/opt-66b/blob/main/config.json — 65,719,701,504 parameters
    "opt-66b": dict(model_type="opt", vocab_size=50272, hidden_size=9216, ffn_dim=36864, num_hidden_layers=64,
                    num_attention_heads=72, max_position_embeddings=2048, word_embed_proj_dim=9216,
                    activation_function="relu", do_layer_norm_before=True, enable_bias=True,
                    bos_token_id=2, eos_token_id=2),
}

#: Named shapes of real models, for costing without downloading them (OPT's can be costed, not run).
MODEL_PRESETS: dict[str, ModelConfig] = {name: ModelConfig.from_dict(raw, cost_only=True)
                                         for name, raw in _PRESET_CONFIGS.items()}


def preset(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of a real model by name (see :data:`MODEL_PRESETS`)."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(MODEL_PRESETS)}") from None


__all__ = [
    "A100_80GB",
    "H100_SXM",
    "H200",
    "MODEL_PRESETS",
    "DeviceSpec",
    "ParamCounts",
    "StepCost",
    "arithmetic_intensity",
    "count_parameters",
    "decode_cost",
    "kv_bytes_per_token",
    "matmul_weights_per_token",
    "mha_kv_bytes_per_token",
    "prefill_cost",
    "preset",
    "step_cost",
]
