"""One decoder-only transformer covering Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3.

The families differ in a few switches read from :class:`~minipd.config.ModelConfig`: q/k/v
biases (Qwen2), per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral), llama3 RoPE
scaling, tied embeddings, and a routed mixture of experts in place of the MLP (Mixtral; in some
layers only and with a gated shared expert for the Qwen-MoE families). DeepSeek-V3 swaps the
attention for multi-head latent attention (:mod:`minipd.layers.mla`) and routes by sigmoid scores
within expert groups, with ungated shared experts and dense first layers.
"""

from __future__ import annotations

import torch
from torch import nn

from minipd.config import ModelConfig
from minipd.kernels.backend import TORCH_BACKEND, KernelBackend
from minipd.kv.base import KVCache
from minipd.layers.attention import attention
from minipd.layers.mla import MultiHeadLatentAttention
from minipd.layers.mlp import SwiGLU
from minipd.layers.moe import MoE
from minipd.layers.norm import RMSNorm
from minipd.layers.rotary import RotaryEmbedding
from minipd.models.forward_context import ForwardContext


class SelfAttention(nn.Module):
    """Grouped-query self-attention with RoPE; q, k and v come from one fused projection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                kernels: KernelBackend | None = None) -> torch.Tensor:
        # (None, not TORCH_BACKEND, as the default: torch 2.11's compiler cannot wrap an object held in defaults.)
        kernels = TORCH_BACKEND if kernels is None else kernels
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k heads side by side, so RoPE is one pass over both.
            qk = qkv[:, :self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = kernels.rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim), kernels.rms_norm)
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads,
                                                                                 self.head_dim), kernels.rms_norm)
            q, k = kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin)
        if cache is None:
            out = attention(q, k, v, self.scale, self.sliding_window)
        else:
            # K and V are kept for every later token; Q is used once, right here, and dropped.
            out = cache.attend(self.layer_idx, q, k, v, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: nn.Module = (MultiHeadLatentAttention(config, layer_idx) if config.is_mla
                                     else SelfAttention(config, layer_idx))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layer_is_moe(layer_idx):
            self.mlp: nn.Module = MoE(config.hidden_size, config.expert_intermediate_size, config.num_experts,
                                      config.num_experts_per_tok, scoring=config.router_scoring,  # type: ignore[arg-type]
                                      renormalize=config.norm_topk_prob, n_group=config.n_group,
                                      topk_group=config.topk_group,
                                      routed_scaling_factor=config.routed_scaling_factor,
                                      shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                                      shared_expert_gated=config.shared_expert_gated)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        kernels = context.kernels
        h = self.input_layernorm(x, kernels.rms_norm)
        attn_out = self.self_attn(h, cos, sin, context.cache, kernels)
        # x + attn_out and its RMSNorm in one kernel: the sum is the residual stream, the norm feeds the MLP.
        h, x = self.post_attention_layernorm.add_and_norm(attn_out, x, kernels.add_rms_norm)
        return x + self.mlp(h, kernels.silu_mul)


class DecoderModel(nn.Module):
    """Embedding, a stack of :class:`DecoderLayer`, a final norm and the LM head."""

    def __init__(self, config: ModelConfig) -> None:
        if config.cost_only:
            raise ValueError(f"minipd can cost a {config.model_type!r} model (minipd.sim.costs) but not build one: "
                             "it builds SwiGLU decoders with RoPE and RMSNorm")
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # MLA rotates only each head's decoupled rope part; other families the whole head.
        self.rotary = RotaryEmbedding(config.rope_dim, config.max_position_embeddings, config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                context: ForwardContext | KVCache | None = None) -> torch.Tensor:
        """Hidden states (T, hidden) for ``input_ids`` (T,) at ``positions`` (T,).

        ``context`` carries this pass's KV cache and kernels (a bare cache means the torch kernels).
        With a cache, the new tokens' K/V are appended to it and the queries attend to everything
        cached before them, so prefill (many tokens) and decode (one token) are the same call.
        """
        context = ForwardContext.of(context)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, context)
        if context.cache is not None:
            context.cache.advance(input_ids.shape[0])
        return self.norm(x, context.kernels.rms_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits from final hidden states, in fp32."""
        return self.lm_head(hidden).float()
