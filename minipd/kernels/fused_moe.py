"""A fused mixture-of-experts forward in Triton: block-aligned token permutation and two grouped GEMMs.

The plain paths (:class:`~minipd.moe.experts.StackedExperts`) first copy every (token, slot) row into
one contiguous block per expert, then multiply. The fused path never builds that copy:

1. :func:`align_to_blocks` sorts the (token, slot) pairs by expert and pads each expert's run to a
   multiple of ``BLOCK_M`` rows, so every tile of ``BLOCK_M`` rows belongs to one expert. Pads point
   at a sentinel pair, which the kernels mask out.
2. The first kernel gathers each tile's token rows straight from the hidden states, multiplies them by
   the expert's gate and up matrices, and applies SwiGLU (``silu(gate) * up``) before storing: the
   activation never makes a round trip to memory.
3. The second kernel multiplies those rows by the expert's down matrix and scales each by its routing
   weight; a sum over each token's ``top_k`` rows finishes the layer.

:func:`fused_moe_torch` is the same computation in plain torch, the reference the kernel is tested
against (under ``TRITON_INTERPRET=1`` on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

#: Rows per tile: every tile belongs to one expert. 16 is the smallest ``tl.dot`` takes on NVIDIA GPUs.
BLOCK_M = 16


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[
        torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``sorted_pairs`` (P,): flattened (token, slot) indices, with the sentinel ``T * k`` in the
    pads; and ``block_experts`` (P / block_m,): the expert of each tile. Experts with no pairs get no tile.
    """
    flat = expert_ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = flat.argsort(stable=True)
    starts = torch.cumsum(padded, 0) - padded  # where each expert's run begins in the padded list
    first = torch.cumsum(counts, 0) - counts  # where it begins in the sorted pairs
    total = int(padded.sum())
    sorted_pairs = torch.full((total,), flat.numel(), dtype=torch.int64, device=flat.device)
    rank = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]  # position within the expert
    sorted_pairs[starts[flat[order]] + rank] = order
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_pairs, block_experts


@triton.jit
def _gate_up_kernel(hidden_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr, num_pairs, top_k,
                    hidden_size, inter_size,
                    stride_h_tok, stride_w_e, stride_w_row, stride_o_pair,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of rows of one expert × ``BLOCK_N`` columns of its intermediate: ``silu(x Wg^T) * (x Wu^T)``."""
    tile, col_tile = tl.program_id(0), tl.program_id(1)
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w_base = w_ptr + expert * stride_w_e
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        x = tl.load(hidden_ptr + tokens[:, None] * stride_h_tok + ks[None, :], mask=real[:, None] & k_ok[None, :],
                    other=0.0)
        # W rows are output channels: gate rows 0..I-1, up rows I..2I-1; load them transposed (K, N).
        wg = tl.load(w_base + cols[None, :] * stride_w_row + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                     other=0.0)
        wu = tl.load(w_base + (cols[None, :] + inter_size) * stride_w_row + ks[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        gate = tl.dot(x, wg, gate, input_precision=PRECISION)
        up = tl.dot(x, wu, up, input_precision=PRECISION)
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_o_pair + cols[None, :],
             act.to(out_ptr.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, block_experts_ptr, num_pairs,
                 hidden_size, inter_size,
                 stride_a_pair, stride_w_e, stride_w_row, stride_o_pair,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of rows × ``BLOCK_N`` hidden columns: ``routing weight * (act W_down^T)``."""
    tile, col_tile = tl.program_id(0), tl.program_id(1)
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    rows = pairs.to(tl.int64)
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w_base = w_ptr + expert * stride_w_e
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(act_ptr + rows[:, None] * stride_a_pair + ks[None, :], mask=real[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_w_row + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    scale = tl.load(weights_ptr + rows, mask=real, other=0.0).to(tl.float32)
    out = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o_pair + cols[None, :], out, mask=real[:, None] & col_ok[None, :])


def fused_moe_triton(hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                     gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """The mixture's output (T, H) for ``hidden`` (T, H), routing ``weights`` and ``expert_ids`` (T, k), and
    stacked expert weights ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)."""
    tokens, hidden_size = hidden.shape
    top_k = expert_ids.shape[1]
    num_experts, double_inter, _ = gate_up_proj.shape
    inter = double_inter // 2
    if tokens == 0:
        return torch.empty_like(hidden)
    hidden, gate_up_proj, down_proj = hidden.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    sorted_pairs, block_experts = align_to_blocks(expert_ids, num_experts)
    num_pairs = tokens * top_k
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    fp32 = hidden.dtype == torch.float32
    options = {"BLOCK_M": BLOCK_M, "BLOCK_N": 32, "BLOCK_K": 32, "PRECISION": "ieee" if fp32 else None}
    tiles = block_experts.numel()
    _gate_up_kernel[(tiles, triton.cdiv(inter, 32))](
        hidden, gate_up_proj, act, sorted_pairs, block_experts, num_pairs, top_k, hidden_size, inter,
        hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0), **options)
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(tiles, triton.cdiv(hidden_size, 32))](
        act, down_proj, out, flat_weights, sorted_pairs, block_experts, num_pairs, hidden_size, inter,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0), **options)
    return out.view(tokens, top_k, hidden_size).sum(dim=1)


def fused_moe_torch(hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """The reference for :func:`fused_moe_triton`: every (token, slot) pair through its expert, weighted, summed."""
    tokens, top_k = expert_ids.shape
    inter = gate_up_proj.shape[1] // 2
    out = torch.zeros(tokens, top_k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for expert in expert_ids.unique().tolist():
        token, slot = (expert_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[token].float(), gate_up_proj[expert].float()).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert].float())
        out[token, slot] = y * weights[token, slot].float().unsqueeze(-1)
    return out.sum(dim=1).to(hidden.dtype)
