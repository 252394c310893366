"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention: a KV cache compressed by the model itself.

Each token's hidden state is projected down to one small latent (``kv_lora_rank`` numbers, RMS-normed)
and one rotary key of ``qk_rope_head_dim`` shared by all heads. Those two are all the cache keeps: per
head keys and values are linear functions of the latent (``kv_b_proj``), recomputed when attending or
folded into the query (see :mod:`minipd.kernels.mla`). Position enters only through the small
decoupled rope part, so the latent stays position-free and the up-projection can be absorbed.

The query comes straight from the hidden state (``q_lora_rank`` None) or through its own normed
low-rank bottleneck; its per-head vector is a no-rope part (scored against the latent's keys) and a
rope part (scored against the shared rotary key).
"""

from __future__ import annotations

import torch
from torch import nn

from minipd.config import ModelConfig
from minipd.kernels.backend import TORCH_BACKEND, KernelBackend
from minipd.kernels.mla import LatentUpProjection, expanded_latent_attention
from minipd.kv.base import KVCache
from minipd.layers.norm import RMSNorm
from minipd.layers.rotary import deinterleave, yarn_mscale


def mla_softmax_scale(config: ModelConfig) -> float:
    """``1/sqrt(qk_head_dim)``, times YaRN's ``mscale(factor, mscale_all_dim)²`` when the rope is stretched
    (DeepSeek rescales the logits so attention keeps its sharpness over the longer context)."""
    scale = config.head_dim**-0.5
    rope = config.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V3's attention; the submodules carry HF's names so checkpoints load one to one.

    The cache stores, per token, ``[latent (after its norm), k_rope (after RoPE)]``: normed once when
    written rather than at every read, and rotated once, as ordinary keys are.
    """

    #: Compute one-query rows (decodes) in the absorbed form; False expands the latents as prefill does.
    absorb_decode: bool = True

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        if not config.is_mla:
            raise ValueError("MultiHeadLatentAttention needs an MLA config (kv_lora_rank > 0)")
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = config.head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = config.rope_interleave
        self.scale = mla_softmax_scale(config)
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.qk_head_dim, bias=False)
        # Down to what the cache keeps: the latent and the shared rotary key, in one projection.
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        # Up from the latent to every head's no-rope key and value (rows head by head: nope, then v).
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)

    def up_projection(self) -> LatentUpProjection:
        """``kv_b_proj`` split into W_UK and W_UV per head (views, no copy)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return LatentUpProjection(w[:, :self.nope_dim], w[:, self.nope_dim:], self.absorb_decode)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                kernels: KernelBackend | None = None) -> torch.Tensor:
        kernels = TORCH_BACKEND if kernels is None else kernels  # (see SelfAttention.forward: not a default)
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x), kernels.rms_norm))  # type: ignore[misc]
        q = q.view(tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent, kernels.rms_norm)
        if self.rope_interleave:  # DeepSeek's adjacent pairs as the halves apply_rotary turns
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope = kernels.rotary(q_rope, cos, sin)
        k_rope = kernels.rotary(k_rope[:, None, :], cos, sin)[:, 0]
        q = torch.cat((q_nope, q_rope), dim=-1)
        rows = torch.cat((latent, k_rope), dim=-1)  # what the cache keeps for this token
        up = self.up_projection()
        if cache is None:
            out = expanded_latent_attention(q, rows, self.scale, up)
        else:
            attend_latent = getattr(cache, "attend_latent", None)
            if attend_latent is None:
                raise ValueError(f"{type(cache).__name__} keeps per-head K/V and cannot serve multi-head latent "
                                 "attention (DeepSeek-V3); use the paged engine or ContiguousKVCache")
            out = attend_latent(self.layer_idx, q, rows, self.scale, up)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_head_dim))
