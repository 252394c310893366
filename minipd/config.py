"""Model configuration read from a Hugging Face ``config.json``.

transformers 4.x writes ``rope_theta`` and ``rope_scaling``; 5.x folds both into
``rope_parameters``. :class:`ModelConfig` reads either, so checkpoints from both eras load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: HF ``model_type`` values of the dense decoder families minipd implements.
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: Mixture-of-experts families: the same attention, with a routed set of SwiGLU experts as the MLP
#: (Qwen2-MoE adds an always-on shared expert behind a sigmoid gate). DeepSeek-V3 routes by sigmoid
#: scores within expert groups, adds ungated shared experts, keeps its first layers dense, and replaces
#: per-head K/V with multi-head latent attention (MLA).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
SUPPORTED_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
#: Families minipd can cost (:mod:`minipd.sim.costs`) but not run: OPT has a two-matrix ReLU MLP with biases,
#: learned absolute positions and LayerNorm. :meth:`ModelConfig.from_dict` reads them only with
#: ``cost_only=True``, and :class:`~minipd.models.decoder.DecoderModel` refuses to build them.
COST_ONLY_FAMILIES = ("opt",)
#: Fields every ``config.json`` must give, each a positive integer.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: Fields that may be absent or null, but when given must be positive integers.
OPTIONAL_POSITIVE_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base ``theta`` and optional llama3- or YaRN-style frequency scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    #: YaRN: the rotation counts bounding the band blended between interpolation and extrapolation.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: YaRN: ``mscale`` and ``mscale_all_dim`` set the factor cos/sin are multiplied by (and DeepSeek's
    #: softmax scale); ``attention_factor`` overrides the former when the config gives it.
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, independent of which library saved it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    #: Bias on the attention output projection (Llama and Qwen3 with ``attention_bias``; never Qwen2).
    o_proj_bias: bool = False
    qk_norm: bool = False
    #: Per layer: ``None`` for full attention, else the number of most recent keys a query sees.
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hidden_act: str = "silu"
    #: Mixture of experts: experts per layer (0 for a dense MLP) and how many each token uses.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    #: Each expert's hidden width (Qwen-MoE's ``moe_intermediate_size``; 0: ``intermediate_size``).
    moe_intermediate_size: int = 0
    #: Qwen2-MoE's shared expert, run for every token behind a sigmoid gate (0: none).
    shared_expert_intermediate_size: int = 0
    #: Rescale the kept top-k probabilities to sum to 1 (Mixtral always; Qwen-MoE's ``norm_topk_prob``).
    norm_topk_prob: bool = True
    #: Per layer: True where the MLP is the mixture (Qwen-MoE may keep dense MLPs in some layers).
    moe_layers: tuple[bool, ...] = ()
    #: How the router scores experts: ``"softmax"`` (Mixtral, Qwen-MoE) or ``"sigmoid"`` with a
    #: selection-only bias and group-limited top-k (DeepSeek-V3: ``n_group``, ``topk_group``).
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    #: DeepSeek-V3 multiplies the routed experts' weights by this before adding the shared experts.
    routed_scaling_factor: float = 1.0
    #: Whether the shared expert sits behind a per-token sigmoid gate (Qwen2-MoE) or is added as is (DeepSeek).
    shared_expert_gated: bool = True
    #: Multi-head latent attention (DeepSeek-V3); ``kv_lora_rank`` 0 means ordinary per-head K/V.
    #: Queries come from ``hidden`` directly (``q_lora_rank`` None) or through a rank-``q_lora_rank`` bottleneck;
    #: keys and values are up-projected from one ``kv_lora_rank`` latent per token, plus one
    #: ``qk_rope_head_dim`` rotary key shared by all heads. ``head_dim`` is then the q/k head size
    #: ``qk_nope_head_dim + qk_rope_head_dim``, and each head's value has ``v_head_dim``.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    #: RoPE on channel pairs ``(0, 1), (2, 3), ...`` instead of halves ``(i, i + d/2)`` (DeepSeek's layout).
    rope_interleave: bool = False
    # The four fields below describe families minipd costs but does not run (:data:`COST_ONLY_FAMILIES`).
    #: A SwiGLU MLP (gate, up, down); False for OPT's two matrices, ``fc1 → hidden_act → fc2``.
    gated_mlp: bool = True
    #: Biases on the MLP's matrices (OPT).
    mlp_bias: bool = False
    #: LayerNorms with a bias as well as a weight in place of RMSNorm (OPT).
    norm_bias: bool = False
    #: Rows of a learned absolute position table (OPT: ``max_position_embeddings + 2``); 0 for none (RoPE).
    learned_positions: int = 0

    @property
    def cost_only(self) -> bool:
        """True for a shape minipd can cost but not build: anything but a SwiGLU, RoPE and RMSNorm decoder."""
        return (self.model_type in COST_ONLY_FAMILIES or not self.gated_mlp or self.mlp_bias or self.norm_bias
                or self.learned_positions > 0 or self.hidden_act != "silu")

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention: the cache keeps a latent per token, not per-head K and V."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates per head: all of ``head_dim``, or MLA's decoupled rope part."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Elements MLA caches per token and layer: the latent and the shared rotary key (0 without MLA)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 0

    @property
    def is_moe(self) -> bool:
        """True when the MLP of some layer is a routed mixture of experts."""
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts."""
        return self.moe_layers[layer] if self.moe_layers else self.is_moe

    @property
    def expert_intermediate_size(self) -> int:
        """The hidden width of one routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def gqa_group_size(self) -> int:
        """How many query heads share one key/value head (1 means plain multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of K and V one token keeps in the cache across all layers (MLA: its latent and rope key)."""
        if self.is_mla:
            return self.num_hidden_layers * self.kv_latent_dim * bytes_per_element
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, cost_only: bool = False) -> ModelConfig:
        """Build from the parsed contents of an HF ``config.json``.

        Raises ``ValueError`` naming the field when a required one is missing or not a positive integer.
        With ``cost_only=True`` the families minipd can only cost (:data:`COST_ONLY_FAMILIES`) are read too;
        the result can be given to :mod:`minipd.sim.costs`, not built into a model.
        """
        if not isinstance(raw, dict):
            raise ValueError(f"the config must be a JSON object of fields, got {type(raw).__name__}")
        model_type = raw.get("model_type", "")
        if model_type in COST_ONLY_FAMILIES:
            if cost_only:
                return _read_opt(raw)
            raise ValueError(f"model_type {model_type!r} is not supported; minipd implements "
                             f"{', '.join(SUPPORTED_FAMILIES)} (it can cost {model_type!r} shapes: "
                             "ModelConfig.from_dict(raw, cost_only=True) and minipd.sim.costs)")
        _check_fields(raw)
        if model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; minipd implements {', '.join(SUPPORTED_FAMILIES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        mla = _read_mla(raw, model_type)
        if mla:
            # HF sets DeepSeek's head_dim to the rope part (for its rotary table); ours is the q/k head size.
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        layers = raw["num_hidden_layers"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_read_rope(raw),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=_qkv_bias(raw, model_type),
            o_proj_bias=model_type not in ("qwen2", "qwen2_moe") and bool(raw.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_windows=_read_sliding_windows(raw, layers),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            **_read_moe(raw, model_type, layers),
            **mla,
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        """Read ``config.json`` from a local HF-format model folder.

        A file that is not valid JSON, or lacks what minipd needs, is a ``ValueError`` whose message
        starts with the file's path; a missing file is a ``FileNotFoundError`` naming it.
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (a model folder needs an HF config.json)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}); is the file truncated or corrupt?") from err
        try:
            return cls.from_dict(raw)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err


def _read_opt(raw: dict[str, Any]) -> ModelConfig:
    """An OPT ``config.json`` (``ffn_dim`` for the MLP width), for costing only.

    OPT's pre-LayerNorm checkpoints whose embedding width is the hidden size (OPT-1.3B and up, and 125M) are
    read; OPT-350M (a projected 512-wide embedding, post-LayerNorm) is refused rather than miscounted.
    """
    raw = {**raw, "intermediate_size": raw.get("ffn_dim")}
    _check_fields(raw)
    hidden = raw["hidden_size"]
    if raw.get("word_embed_proj_dim", hidden) != hidden:
        raise ValueError(f"OPT with word_embed_proj_dim {raw['word_embed_proj_dim']} != hidden_size {hidden} "
                         "(project_in/project_out) is not supported")
    if not raw.get("do_layer_norm_before", True) or raw.get("_remove_final_layer_norm", False):
        raise ValueError("post-LayerNorm OPT (do_layer_norm_before false) is not supported")
    if not raw.get("layer_norm_elementwise_affine", True):
        raise ValueError("OPT without LayerNorm weights (layer_norm_elementwise_affine false) is not supported")
    bias = bool(raw.get("enable_bias", True))
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    max_positions = raw.get("max_position_embeddings") or 2048
    return ModelConfig(
        model_type="opt",
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,  # nn.LayerNorm's default, which OPT keeps
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=bias,
        o_proj_bias=bias,
        sliding_windows=(None,) * raw["num_hidden_layers"],
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        bos_token_id=raw.get("bos_token_id"),
        hidden_act=raw.get("activation_function", "relu"),
        gated_mlp=False,
        mlp_bias=bias,
        norm_bias=True,
        # OPT's position table has 2 rows more than its context (positions are looked up at offset 2).
        learned_positions=max_positions + 2,
    )


def _check_fields(raw: dict[str, Any]) -> None:
    """Required shape fields present and positive integers, so a bad config fails here and not deep in the model."""
    for name in REQUIRED_FIELDS:
        if name not in raw:
            raise ValueError(f"required field {name!r} is missing")
    for name in REQUIRED_FIELDS + OPTIONAL_POSITIVE_FIELDS:
        value = raw.get(name)
        if name in OPTIONAL_POSITIVE_FIELDS and value is None:
            continue
        # bool is an int to Python; JSON true would otherwise pass as 1.
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"field {name!r} must be a positive integer, got {value!r}")


def _read_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; minipd implements 'default', 'llama3' and "
                         "'yarn'")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original:
        # As HF: a YaRN config without a factor stretches the original context to max_position_embeddings.
        factor = raw.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _qkv_bias(raw: dict[str, Any], model_type: str) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE unless ``qkv_bias`` says not; the other families say so with
    ``attention_bias`` (which then covers o_proj too)."""
    if model_type == "qwen2":
        return True
    if model_type == "qwen2_moe":
        return raw.get("qkv_bias", True) is not False
    return bool(raw.get("attention_bias", False))


def _read_moe(raw: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelConfig` (all defaults for a dense family)."""
    if model_type not in MOE_FAMILIES:
        return {}
    experts = raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts") or 0
    if model_type == "deepseek_v3":
        # Layers before first_k_dense_replace keep a dense MLP (as HF; the original code's moe_layer_freq is 1).
        first_sparse = raw.get("first_k_dense_replace") or 0
        return {
            "num_experts": experts,
            "num_experts_per_tok": raw.get("num_experts_per_tok", 0),
            "moe_intermediate_size": raw.get("moe_intermediate_size") or 0,
            # n_shared_experts experts that every token uses are one SwiGLU that many times as wide.
            "shared_expert_intermediate_size": (raw.get("n_shared_experts") or 0) * (raw.get("moe_intermediate_size")
                                                                                     or 0),
            "shared_expert_gated": False,
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            "moe_layers": tuple(experts > 0 and i >= first_sparse for i in range(layers)),
            "router_scoring": "sigmoid",
            "n_group": raw.get("n_group") or 1,
            "topk_group": raw.get("topk_group") or 1,
            "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
        }
    if model_type == "mixtral":
        return {"num_experts": experts, "num_experts_per_tok": raw.get("num_experts_per_tok", 0)}
    # Qwen-MoE: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer.
    dense = set(raw.get("mlp_only_layers") or ())
    step = raw.get("decoder_sparse_step") or 1
    return {
        "num_experts": experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok", 0),
        "moe_intermediate_size": raw.get("moe_intermediate_size") or 0,
        "shared_expert_intermediate_size": (raw.get("shared_expert_intermediate_size") or 0
                                            if model_type == "qwen2_moe" else 0),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "moe_layers": tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)),
    }


def _read_mla(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The multi-head latent attention fields of :class:`ModelConfig` (none for a family without MLA)."""
    if model_type != "deepseek_v3":
        return {}
    fields = {name: raw.get(name) for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"field {name!r} must be a positive integer, got {value!r}")
    if fields["qk_rope_head_dim"] % 2:
        raise ValueError(f"field 'qk_rope_head_dim' must be even (RoPE turns channel pairs), got "
                         f"{fields['qk_rope_head_dim']}")
    q_lora_rank = raw.get("q_lora_rank")
    if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or isinstance(q_lora_rank, bool)
                                    or q_lora_rank < 1):
        raise ValueError(f"field 'q_lora_rank' must be null or a positive integer, got {q_lora_rank!r}")
    # HF's default is interleaved pairs, so a config.json that does not say is interleaved.
    return {**fields, "q_lora_rank": q_lora_rank, "rope_interleave": bool(raw.get("rope_interleave", True))}


def _read_sliding_windows(raw: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if raw.get("model_type") in ("mistral", "mixtral") and window:
        return (window,) * layers
    if raw.get("use_sliding_window") and window:
        first_sliding = raw.get("max_window_layers", layers)
        return tuple(window if i >= first_sliding else None for i in range(layers))
    return (None,) * layers
