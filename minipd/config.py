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
#: (Qwen2-MoE adds an always-on shared expert behind a sigmoid gate).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
#: Fields every ``config.json`` must give, each a positive integer.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: Fields that may be absent or null, but when given must be positive integers.
OPTIONAL_POSITIVE_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base ``theta`` and optional llama3-style frequency scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


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
        """Bytes of K and V one token keeps in the cache across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of an HF ``config.json``.

        Raises ``ValueError`` naming the field when a required one is missing or not a positive integer.
        """
        if not isinstance(raw, dict):
            raise ValueError(f"the config must be a JSON object of fields, got {type(raw).__name__}")
        _check_fields(raw)
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; minipd implements {', '.join(SUPPORTED_FAMILIES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
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
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; minipd implements 'default' and 'llama3'")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
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
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
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
