"""The Triton kernels against their torch references, on random inputs and on the edge cases.

Without a GPU the kernels run in the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set below
before anything imports triton), so the shapes here are small. With one (``scripts/gpu_check.sh``)
the same tests run the compiled kernels on CUDA, plus bf16.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read as each kernel is defined, so before the imports below

import pytest

from minipd.kernels.kv_store import store_kv_torch
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from minipd.kernels.rms_norm import add_rms_norm_torch
from minipd.kernels.triton_kv_store import store_kv_triton
from minipd.kernels.triton_paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from minipd.kernels.triton_rms_norm import add_rms_norm_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter computes in numpy, which has no bf16; compiled runs cover it.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
#: (atol, rtol) for attention outputs, whose entries are averages of unit-scale values.
ATTN_TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def make_pool(lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
              seed: int = 0, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random K/V pool holding sequences of ``lens`` tokens in shuffled, non-contiguous blocks.

    Returns ``(k_cache, v_cache, block_tables, context_lens)``. A few spare blocks are never handed
    out, and table rows are padded with a valid id. With ``poison``, every slot no sequence owns
    (spare blocks, the tail of each last block) holds NaN, so a kernel that reads past a sequence's
    end, or mixes masked rows in by multiplying with zero, returns NaN.
    """
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.full((len(lens), max(counts)), int(order[-1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(counts):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    if poison:
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, n in enumerate(lens):
            slots = tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
            owned[slots] = True
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[~owned] = float("nan")
    to = {"device": DEVICE}
    return k_cache.to(**to), v_cache.to(**to), tables.to(**to), torch.tensor(lens, dtype=torch.int32, **to)


def clean(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` with NaN poison replaced by zeros, for the reference (which masks after multiplying)."""
    return torch.nan_to_num(cache, nan=0.0)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


# --- store_kv ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_store_kv_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    kv_heads, head_dim, num_blocks = 3, 32, 6
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:11].to(DEVICE)
    # K and V as the model makes them: strided slices of one fused projection, not contiguous tensors.
    fused = randn(11, 2 * kv_heads + 1, head_dim, dtype=dtype, seed=2)
    k, v = fused[:, :kv_heads], fused[:, kv_heads:2 * kv_heads]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0)


def test_store_kv_skips_negative_slots() -> None:
    kv_heads, head_dim, block_size = 2, 32, 8
    k = randn(5, kv_heads, head_dim, dtype=torch.float32, seed=3)
    v = randn(5, kv_heads, head_dim, dtype=torch.float32, seed=4)
    slots = torch.tensor([9, -1, 0, -1, 23], device=DEVICE)
    k_cache = torch.full((4, block_size, kv_heads, head_dim), 7.0, device=DEVICE)
    v_cache = torch.full_like(k_cache, 7.0)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    for row, slot in [(0, 9), (2, 0), (4, 23)]:
        torch.testing.assert_close(flat_k[slot], k[row], atol=0, rtol=0)
        torch.testing.assert_close(flat_v[slot], v[row], atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[[9, 0, 23]] = False
    assert bool((flat_k[untouched] == 7.0).all()) and bool((flat_v[untouched] == 7.0).all())


def test_store_kv_with_nothing_to_store_is_a_no_op() -> None:
    cache = torch.zeros(2, 8, 1, 32, device=DEVICE)
    empty = torch.zeros(0, 1, 32, device=DEVICE)
    store_kv_triton(empty, empty, cache, cache.clone(), torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert not bool(cache.any())


# --- decode attention ----------------------------------------------------------------------------

#: (label, context lengths, q_heads, kv_heads, head_dim, block_size, sliding window)
DECODE_CASES = [
    ("context 1", [1], 4, 4, 32, 16, None),
    ("on and off block boundaries", [16, 32, 15, 33], 4, 4, 32, 16, None),
    ("GQA 4 (8 q heads, 2 kv heads)", [7, 40], 8, 2, 32, 16, None),
    ("GQA 8 (8 q heads, 1 kv head), block 8", [9, 64], 8, 1, 64, 8, None),
    ("lengths 1, 17, 300 in one launch", [1, 17, 300], 4, 2, 32, 16, None),
    ("sliding window 24, shorter and longer contexts", [5, 24, 25, 100], 4, 2, 32, 16, 24),
    ("head_dim 128, block 32", [50, 3], 2, 1, 128, 32, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_paged_decode_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    _, lens, q_heads, kv_heads, head_dim, block_size, window = case
    k_cache, v_cache, tables, context = make_pool(lens, kv_heads, head_dim, block_size, dtype, poison=True)
    q = randn(len(lens), q_heads, head_dim, dtype=dtype, seed=5)
    scale = head_dim**-0.5
    got = paged_decode_attention_triton(q, k_cache, v_cache, tables, context, scale, window)
    # The reference in fp32 on the same (rounded) inputs: the kernel accumulates in fp32 too.
    want = paged_decode_attention_torch(q.float(), clean(k_cache).float(), clean(v_cache).float(), tables, context,
                                        scale, window)
    atol, rtol = ATTN_TOL[dtype]
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_paged_decode_reads_strided_queries() -> None:
    """Queries sliced out of a fused projection (non-contiguous rows) give the same answer."""
    k_cache, v_cache, tables, context = make_pool([20, 3], 2, 32, 16, torch.float32)
    fused = randn(2, 8, 32, dtype=torch.float32, seed=6)
    q = fused[:, :4]
    got = paged_decode_attention_triton(q, k_cache, v_cache, tables, context, 0.2)
    want = paged_decode_attention_torch(q.contiguous(), k_cache, v_cache, tables, context, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# --- prefill attention ---------------------------------------------------------------------------

#: (label, context lengths, new-query counts, q_heads, kv_heads, head_dim, block_size, sliding window)
PREFILL_CASES = [
    ("whole prompts 1, 17, 40", [1, 17, 40], [1, 17, 40], 4, 2, 32, 16, None),
    ("chunks after a cached prefix", [20, 64, 90], [4, 64, 33], 4, 4, 32, 16, None),
    ("decode-like rows mixed with a chunk", [300, 9, 48], [1, 1, 40], 8, 2, 32, 16, None),
    ("GQA 8, block 8", [33, 16], [33, 5], 8, 1, 64, 8, None),
    ("sliding window 16", [40, 12, 70], [40, 12, 20], 4, 2, 32, 16, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_paged_prefill_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    _, lens, q_lens, q_heads, kv_heads, head_dim, block_size, window = case
    k_cache, v_cache, tables, context = make_pool(lens, kv_heads, head_dim, block_size, dtype, poison=True)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(sum(q_lens), q_heads, head_dim, dtype=dtype, seed=7)
    scale = head_dim**-0.5
    got = paged_prefill_attention_triton(q, k_cache, v_cache, tables, starts, context, scale, window)
    want = paged_prefill_attention_torch(q.float(), clean(k_cache).float(), clean(v_cache).float(), tables, starts,
                                         context, scale, window)
    atol, rtol = ATTN_TOL[dtype]
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_prefill_and_decode_agree_on_a_single_query() -> None:
    """A one-row chunk is a decode step: both kernels must give the same row."""
    k_cache, v_cache, tables, context = make_pool([37, 5], 2, 32, 8, torch.float32, seed=3)
    q = randn(2, 4, 32, dtype=torch.float32, seed=8)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    decode = paged_decode_attention_triton(q, k_cache, v_cache, tables, context, 0.3)
    prefill = paged_prefill_attention_triton(q, k_cache, v_cache, tables, starts, context, 0.3)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-5)


# --- fused residual add + RMSNorm ----------------------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype", "weight_dtype"), [
    ((3, 96), torch.float32, torch.float32),  # hidden size not a power of two
    ((2, 5, 64), torch.float16, torch.float16),  # leading batch dimensions
    ((4, 128), torch.float16, torch.float32),  # fp32 weight on fp16 activations promotes the output
    ((1, 1024), torch.float32, torch.float32),
    *([((4, 1024), torch.bfloat16, torch.bfloat16)] if DEVICE.type == "cuda" else []),
])
def test_add_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    x = randn(*shape, dtype=dtype, seed=9)
    residual = randn(*shape, dtype=dtype, seed=10) * 3
    weight = randn(shape[-1], dtype=weight_dtype, seed=11)
    x_before, res_before = x.clone(), residual.clone()
    normed, new_residual = add_rms_norm_triton(x, residual, weight, 1e-6)
    want_normed, want_residual = add_rms_norm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    # One rounding step of the output dtype, since torch.rsqrt and 1/sqrt may differ in the last bit.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert normed.dtype == want_normed.dtype
    torch.testing.assert_close(normed, want_normed, atol=tol, rtol=tol)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs left alone


# --- quantized caches (int8, fp8): the kernels dequantize tiles as they load them -------------------


def quantized_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, fmt_name: str, dtype: torch.dtype):
    """The same pool quantized per token and KV head: views for the kernels, and the dequantized floats."""
    from minipd.kv.quant import FORMATS, QuantizedLayerCache

    fmt = FORMATS[fmt_name]
    views, floats = [], []
    for cache in (k_cache, v_cache):
        codes, scales = fmt.quantize(clean(cache))
        views.append(QuantizedLayerCache(codes, scales, fmt, dtype))
        floats.append(fmt.dequantize(codes, scales, torch.float32))
    return views, floats


@pytest.mark.parametrize("fmt_name", ["int8", "fp8", "int4_per_token"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_decode_and_prefill_match_the_dequantizing_reference(fmt_name: str, dtype: torch.dtype) -> None:
    lens, q_lens = [1, 17, 40, 9], [1, 17, 5, 9]
    k_cache, v_cache, tables, context = make_pool(lens, 2, 32, 16, torch.float32, seed=11)
    (kq, vq), (kf, vf) = quantized_caches(k_cache, v_cache, fmt_name, dtype)
    atol, rtol = ATTN_TOL[dtype]
    q = randn(len(lens), 8, 32, dtype=dtype, seed=12)
    got = paged_decode_attention_triton(q, kq, vq, tables, context, 0.2, None)
    want = paged_decode_attention_torch(q.float(), kf, vf, tables, context, 0.2, None)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch_view = paged_decode_attention_torch(q, kq, vq, tables, context, 0.2, None)  # the reference's own path
    torch.testing.assert_close(torch_view.float(), want, atol=atol, rtol=rtol)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    qp = randn(sum(q_lens), 8, 32, dtype=dtype, seed=13)
    got = paged_prefill_attention_triton(qp, kq, vq, tables, starts, context, 0.2, 24)
    want = paged_prefill_attention_torch(qp.float(), kf, vf, tables, starts, context, 0.2, 24)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


class _NoPlan:
    step_plan = None


def kivi_caches(lens: list[int], dtype: torch.dtype, seed: int):
    """A KIVI pool (int4, K per channel per block, V per token) whose sequences' partly filled last blocks
    sit in residual slots: the kernels' views and tables, and float caches and tables holding exactly what
    they stand for (full blocks dequantized, residual rows as they are)."""
    from minipd.kv.quant import FORMATS
    from minipd.kv.residual import WindowedLayerCache

    fmt, bs = FORMATS["int4"], 16
    k_cache, v_cache, tables, context = make_pool(lens, 2, 32, bs, torch.float32, seed=seed)
    num_blocks = k_cache.shape[0]
    residual = [torch.randn((len(lens), bs, 2, 32), generator=torch.Generator().manual_seed(seed + i)).to(dtype)
                for i in range(2)]
    views, floats = [], []
    window_tables = tables.clone()
    for i, n in enumerate(lens):
        if n % bs:  # the last block is filling: its rows live in residual slot i
            window_tables[i, n // bs] = num_blocks + i
    for which, (cache, per_channel) in enumerate(((k_cache, True), (v_cache, False))):
        blocks = cache.to(torch.float32)
        codes, scales = fmt.quantize_channels(blocks) if per_channel else fmt.quantize(blocks)
        view = WindowedLayerCache(codes, scales, residual[which].to(DEVICE), fmt, dtype, per_channel, _NoPlan())
        values = view.decode_blocks(codes, scales).float()
        for i, n in enumerate(lens):
            if n % bs:
                values[tables[i, n // bs]] = residual[which][i].float()
        views.append(view)
        floats.append(values)
    return views, floats, window_tables, tables, context


@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_decode_and_prefill_match_the_dequantizing_reference(dtype: torch.dtype) -> None:
    lens, q_lens = [1, 17, 40, 9, 32], [1, 17, 5, 9, 3]
    (kq, vq), (kf, vf), window_tables, tables, context = kivi_caches(lens, dtype, seed=21)
    atol, rtol = ATTN_TOL[dtype]
    q = randn(len(lens), 8, 32, dtype=dtype, seed=22)
    want = paged_decode_attention_torch(q.float(), kf, vf, tables, context, 0.2, None)
    for kernel in (paged_decode_attention_triton, paged_decode_attention_torch):
        got = kernel(q, kq, vq, window_tables, context, 0.2, None)
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    qp = randn(sum(q_lens), 8, 32, dtype=dtype, seed=23)
    want = paged_prefill_attention_torch(qp.float(), kf, vf, tables, starts, context, 0.2, 24)
    for kernel in (paged_prefill_attention_triton, paged_prefill_attention_torch):
        got = kernel(qp, kq, vq, window_tables, starts, context, 0.2, 24)
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    # The residual rows really are read: spoil them and the answer moves.
    kq.residual.add_(1.0)
    moved = paged_decode_attention_triton(q, kq, vq, window_tables, context, 0.2, None)
    assert not torch.allclose(moved.float(), paged_decode_attention_torch(q.float(), kf, vf, tables, context, 0.2,
                                                                         None), atol=atol, rtol=rtol)


def test_an_engine_on_triton_kernels_with_an_int8_cache_matches_the_torch_one() -> None:
    from minipd import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 99, 4, 300, 21, 8], list(range(40, 75))]
    on_triton = LLM("tiny-py", kernel_backend="triton", kv_cache_dtype="int8", num_kv_blocks=16)
    on_torch = LLM("tiny-py", kernel_backend="torch", kv_cache_dtype="int8", num_kv_blocks=16)
    assert [o.token_ids for o in on_triton.generate(prompts, params, use_tqdm=False)] == \
        [o.token_ids for o in on_torch.generate(prompts, params, use_tqdm=False)]
