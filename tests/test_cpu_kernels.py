"""The C++ CPU paged-attention kernels (prefill, and decode with the new token supplied) against the torch
references, on random pools, and in the engine (``kernel_backend="cpu"``) against ``"torch"``."""

from __future__ import annotations

import pytest
import torch
from helpers import need_cpu_kernel

from minipd import LLM, SamplingParams
from minipd.kernels import cpu_paged_attention
from minipd.kernels.cpu_paged_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu
from minipd.kernels.kv_store import store_kv_torch
from minipd.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch

#: fp32 outputs are averages of unit-scale values: the kernels and the references differ by rounding only.
TOL = dict(rtol=1e-5, atol=1e-5)


def make_pool(lens: list[int], kv_heads: int, head_dim: int, block_size: int, seed: int,
              dtype: torch.dtype = torch.float32,
              poison: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random pool holding sequences of ``lens`` tokens in shuffled blocks: ``(k, v, block_tables, lens)``.

    Table rows are padded with two columns naming a spare block. With ``poison``, every slot no sequence
    owns (spare blocks, each last block's tail) is NaN: a kernel reading past a sequence's end returns NaN.
    (The decode reference multiplies the masked tail of a padded batch by zero, so it needs no poison.)
    """
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max(counts) + 2), int(order[-1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(counts):
        tables[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, n in enumerate(lens):
        owned[_slots(tables[i:i + 1].expand(n, -1), torch.arange(n), block_size)] = True
    for cache in (k, v) if poison else ():
        cache.view(-1, kv_heads, head_dim)[~owned] = float("nan")
    return k.to(dtype), v.to(dtype), tables, torch.tensor(lens, dtype=torch.int32)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of ``positions[i]`` in the sequence of table row ``tables[i]``."""
    blocks = tables.long().gather(1, (positions // block_size)[:, None]).squeeze(1)
    return blocks * block_size + positions % block_size


# ------------------------------------------------------------------------------------------ prefill

CHUNKS = [1, 7, 40, 130]
#: Context beyond each chunk: a continued prompt (chunked prefill or a prefix hit), some off block boundaries.
EARLIER = [12, 0, 33, 21]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_kernel_matches_the_reference(heads, kv_heads, head_dim, block_size, window):
    need_cpu_kernel()
    lens = [c + e for c, e in zip(CHUNKS, EARLIER, strict=True)]
    k, v, tables, context_lens = make_pool(lens, kv_heads, head_dim, block_size, seed=heads * head_dim + block_size)
    starts = [0, *torch.tensor(CHUNKS).cumsum(0).tolist()]
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    q = torch.randn(starts[-1], heads, head_dim, generator=torch.Generator().manual_seed(1))
    want = paged_prefill_attention_torch(q, k, v, tables, query_start_loc, context_lens, head_dim ** -0.5, window)
    got = paged_prefill_attention_cpu(q, k, v, tables, query_start_loc, context_lens, head_dim ** -0.5, window,
                                      query_start_host=starts, context_lens_host=lens)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("window", [None, 1, 5])
def test_prefill_kernel_on_odd_shapes(window):
    """Three query heads per KV head, a head_dim and block size that fill no register, a window of 1."""
    need_cpu_kernel()
    chunks, lens = [3, 50, 1], [3, 61, 9]
    k, v, tables, context_lens = make_pool(lens, 2, 24, 5, seed=7)
    query_start_loc = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    q = torch.randn(sum(chunks), 6, 24)
    want = paged_prefill_attention_torch(q, k, v, tables, query_start_loc, context_lens, 0.3, window)
    torch.testing.assert_close(paged_prefill_attention_cpu(q, k, v, tables, query_start_loc, context_lens, 0.3,
                                                           window), want, **TOL)


def test_prefill_kernel_gives_the_same_answer_on_any_number_of_threads():
    """One long prompt's tiles are shared out among the threads; each tile is computed alike wherever it runs."""
    need_cpu_kernel()
    k, v, tables, context_lens = make_pool([300, 20], 2, 32, 16, seed=3)
    query_start_loc = torch.tensor([0, 280, 300])
    q = torch.randn(300, 8, 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_prefill_attention_cpu(q, k, v, tables, query_start_loc, context_lens, 0.2)
        torch.set_num_threads(2)
        two = paged_prefill_attention_cpu(q, k, v, tables, query_start_loc, context_lens, 0.2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, paged_prefill_attention_torch(q, k, v, tables, query_start_loc, context_lens, 0.2),
                               **TOL)


def test_prefill_kernel_refuses_block_ids_outside_the_pool():
    need_cpu_kernel()
    k, v, tables, context_lens = make_pool([20], 2, 16, 8, seed=0)
    tables[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id"):
        paged_prefill_attention_cpu(torch.randn(4, 4, 16), k, v, tables, torch.tensor([0, 4]), context_lens, 0.25)


def test_prefill_leaves_other_formats_to_the_reference():
    k, v, tables, context_lens = make_pool([5, 20], 2, 16, 8, seed=0, dtype=torch.float16)
    q, query_start_loc = torch.randn(9, 4, 16), torch.tensor([0, 2, 9])
    assert torch.equal(paged_prefill_attention_cpu(q, k, v, tables, query_start_loc, context_lens, 0.25, 4),
                       paged_prefill_attention_torch(q, k, v, tables, query_start_loc, context_lens, 0.25, 4))


# ------------------------------------------------------------------------- decode, new token apart

DECODE_LENS = [1, 8, 9, 16, 17, 100, 33, 64, 2]


def _store_new_rows(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the pool with each sequence's last position holding its new row (as the engine stores it)."""
    slots = _slots(tables, lens.long() - 1, k.shape[1])
    k_stored, v_stored = k.clone(), v.clone()
    store_kv_torch(k_new, v_new, k_stored, v_stored, slots, has_padding=False)
    return k_stored, v_stored


def _poison_new_slots(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    """NaN in each sequence's last slot, which a decode given the new rows apart must not read."""
    slots = _slots(tables, lens.long() - 1, k.shape[1])
    for cache in (k, v):
        cache.view(-1, *cache.shape[2:])[slots] = float("nan")


# Query heads per KV head 4, 1, 8, 5 and 7 (a kernel takes up to 4 at once with AVX2, up to 8 with AVX-512), and a
# head size that is no multiple of 16 (40: AVX-512 registers for 32 entries, AVX2 for the rest).
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (4, 4, 16), (8, 1, 64), (10, 2, 64), (14, 2, 40)])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_decode_with_the_new_token_apart_matches_the_reference_on_a_stored_pool(heads, kv_heads, dim, window):
    need_cpu_kernel()
    k, v, tables, lens = make_pool(DECODE_LENS, kv_heads, dim, 8, seed=heads + dim, poison=False)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(DECODE_LENS), heads, dim, generator=g)
    k_new, v_new = (torch.randn(len(DECODE_LENS), kv_heads, dim, generator=g) for _ in range(2))
    k_stored, v_stored = _store_new_rows(k, v, tables, lens, k_new, v_new)
    want = paged_decode_attention_torch(q, k_stored, v_stored, tables, lens, 0.2, window)
    # The pool given to the kernel holds NaN in the new tokens' slots: they must come from k_new/v_new.
    _poison_new_slots(k, v, tables, lens)
    got = paged_decode_attention_cpu(q, k, v, tables, lens, 0.2, window, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(got, want, **TOL)
    # Without them, the pool that holds the new rows gives the same answer, as before.
    torch.testing.assert_close(paged_decode_attention_cpu(q, k_stored, v_stored, tables, lens, 0.2, window),
                               want, **TOL)


@pytest.mark.parametrize("kernel", [True, False])
def test_decode_with_the_new_token_apart_on_an_fp16_pool_takes_it_as_stored(kernel, monkeypatch):
    # An fp16 pool of an fp32 model: the kernel reads it in place (rows widened to fp32), and the new rows count
    # as the pool would keep them, rounded to fp16. Without the kernel, the fallback stores them into a copy.
    if kernel:
        need_cpu_kernel()
    else:
        monkeypatch.setattr(cpu_paged_attention, "load_kernel", lambda: (None, "not built"))
    k, v, tables, lens = make_pool(DECODE_LENS, 2, 16, 8, seed=11, dtype=torch.float16, poison=False)
    q = torch.randn(len(DECODE_LENS), 4, 16)
    k_new, v_new = torch.randn(len(DECODE_LENS), 2, 16), torch.randn(len(DECODE_LENS), 2, 16)
    k_stored, v_stored = _store_new_rows(k, v, tables, lens, k_new, v_new)  # rounded to fp16 on the way in
    _poison_new_slots(k, v, tables, lens)
    k_before, v_before = k.clone(), v.clone()
    got = paged_decode_attention_cpu(q, k, v, tables, lens, 0.25, 10, k_new=k_new, v_new=v_new)
    want = paged_decode_attention_torch(q, k_stored, v_stored, tables, lens, 0.25, 10)
    assert got.dtype == torch.float32
    if kernel:
        torch.testing.assert_close(got, want, **TOL)
    else:
        assert torch.equal(got, want)
    assert torch.equal(k.isnan(), k_before.isnan()) and torch.equal(k.nan_to_num(), k_before.nan_to_num())
    assert torch.equal(v.isnan(), v_before.isnan()) and torch.equal(v.nan_to_num(), v_before.nan_to_num())
    with pytest.raises(ValueError, match="both k_new and v_new"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 0.25, k_new=k_new)


# bf16 and fp16 pools (a model loaded in that dtype): every path of the kernel — the AVX2 one for head sizes that
# are multiples of 8 (32, 40: an odd multiple), the generic one (36) — against the reference on the widened pool,
# with queries in fp32 (exact up to summation order) and in the pool's dtype (the result rounded to it).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [32, 40, 36])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_reads_bf16_and_fp16_pools_in_place(dtype, dim, window):
    need_cpu_kernel()
    k, v, tables, lens = make_pool(DECODE_LENS, 2, dim, 8, seed=dim, dtype=dtype, poison=False)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(DECODE_LENS), 8, dim, generator=g)
    k_new, v_new = (torch.randn(len(DECODE_LENS), 2, dim, generator=g).to(dtype) for _ in range(2))
    k_stored, v_stored = _store_new_rows(k, v, tables, lens, k_new, v_new)
    want = paged_decode_attention_torch(q, k_stored.float(), v_stored.float(), tables, lens, 0.2, window)
    # Read from a pool whose slots no sequence owns are NaN: nothing past a sequence's end is read.
    poisoned = _store_new_rows(*make_pool(DECODE_LENS, 2, dim, 8, seed=dim, dtype=dtype)[:2], tables, lens, k_new,
                               v_new)
    got = paged_decode_attention_cpu(q, *poisoned, tables, lens, 0.2, window)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)
    narrow = paged_decode_attention_cpu(q.to(dtype), k_stored, v_stored, tables, lens, 0.2, window)
    assert narrow.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    want_narrow = paged_decode_attention_torch(q.to(dtype).float(), k_stored.float(), v_stored.float(), tables, lens,
                                               0.2, window)
    torch.testing.assert_close(narrow.float(), want_narrow, rtol=ulp, atol=1e-3)
    # The new rows apart (the pool's slots for them poisoned), as a compiled step of a bf16 model passes them.
    _poison_new_slots(k, v, tables, lens)
    apart = paged_decode_attention_cpu(q.to(dtype), k, v, tables, lens, 0.2, window, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(apart.float(), want_narrow, rtol=ulp, atol=1e-3)


def test_decode_with_the_new_token_apart_needs_a_context_holding_it():
    need_cpu_kernel()
    k, v, tables, _ = make_pool([4, 6], 2, 16, 8, seed=0)
    rows = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="at least the new token"):
        paged_decode_attention_cpu(torch.randn(2, 4, 16), k, v, tables, torch.tensor([4, 0]), 0.25,
                                   k_new=rows, v_new=rows)


# ------------------------------------------------------------------------------------------ engine

SHARED = ("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every argument with its index.\"\"\"\n"
          "    for i, arg in enumerate(argv):\n        print(i, arg)\n    return 0\n\n\n")
TAILS = ["class Foo:\n    def __init__(self):", "def fib(n):\n    if n < 2:", "x = [i * i for i in"]


def test_cpu_backend_gives_the_reference_tokens_with_chunked_prefill_and_prefix_hits(monkeypatch):
    """16-token steps split every prompt into chunks; the second call's prompts reuse the first's cached
    prefix. Both make prefill chunks whose context is longer than their queries."""
    need_cpu_kernel()
    chunks: list[tuple[int, int]] = []  # (queries, context) of every sequence in every prefill call
    kernel = cpu_paged_attention.paged_prefill_attention_cpu

    def recording(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, *args, **kwargs):
        assert q.dtype == torch.float32 and k_cache.dtype == torch.float32  # what the kernel itself takes
        starts = query_start_loc.tolist()
        chunks.extend((b - a, n) for a, b, n in zip(starts[:-1], starts[1:], context_lens.tolist(), strict=True))
        return kernel(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, *args, **kwargs)

    monkeypatch.setattr(cpu_paged_attention, "paged_prefill_attention_cpu", recording)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for backend in ("torch", "cpu"):
        llm = LLM("tiny-py", kernel_backend=backend, block_size=8, max_num_batched_tokens=16)
        assert llm.engine.core.kernels.name == backend
        first = llm.generate([SHARED + "print(main(sys.argv))"], params)
        rest = llm.generate([SHARED + tail for tail in TAILS] + ["for i in range(10):\n    print("], params)
        assert all(o.metrics.cached_tokens >= 16 for o in rest[:len(TAILS)])  # the prefix was reused
        assert len(first[0].prompt_token_ids) > 16
        runs[backend] = [o.token_ids for o in first + rest]
    assert runs["cpu"] == runs["torch"]
    assert any(context > queries > 1 for queries, context in chunks)


def test_the_build_is_keyed_by_its_inputs_so_checkouts_never_evict_each_other():
    key, tools = cpu_paged_attention.build_key, cpu_paged_attention.toolchain()
    assert key() == key() == key(tools=tools) and len(key()) == 12
    assert key(source=cpu_paged_attention._SOURCE + "\n// another checkout") != key()
    assert key(cflags=("-O2",)) != key()
    # Another virtualenv with the same torch release: torch's include folders differ, and so the build.
    other_venv = tuple("/elsewhere/.venv/torch" if part == tools[2] else part for part in tools)
    assert tools[2] and key(tools=other_venv) != key()
    assert cpu_paged_attention.extension_name().endswith(key())


def test_a_process_that_must_not_build_uses_the_reference_and_compiles_nothing(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    def no_build(*args, **kwargs):
        raise AssertionError("the kernel was compiled")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: nothing built for this key
    monkeypatch.setenv(cpu_paged_attention.NO_BUILD_ENV, "1")
    monkeypatch.setattr(cpp_extension, "load_inline", no_build)
    cpu_paged_attention.load_kernel.cache_clear()
    try:
        # Another checkout's build in the same cache is not this one's.
        other = "minipd_cpu_paged_attention_aaaaaaaaaaaa"
        (tmp_path / other).mkdir()
        (tmp_path / other / f"{other}.so").touch()
        assert not cpu_paged_attention.kernel_built()
        module, why = cpu_paged_attention.load_kernel()
        assert module is None and cpu_paged_attention.NO_BUILD_ENV in why
        # Once this key's build is there too, both live side by side.
        name = cpu_paged_attention.extension_name()
        (tmp_path / name).mkdir(exist_ok=True)  # (asking for a build's folder makes it)
        (tmp_path / name / f"{name}.so").touch()
        assert cpu_paged_attention.kernel_built() and (tmp_path / other / f"{other}.so").is_file()
    finally:
        cpu_paged_attention.load_kernel.cache_clear()


def test_a_process_that_must_not_build_imports_a_finished_build_without_ninja():
    """A worker imports the build as it is (``load_inline`` would run ninja, which may recompile), dispatcher
    op included. In a subprocess: a second import of the extension in this one would register its op twice."""
    import os
    import subprocess
    import sys

    need_cpu_kernel()
    script = """
import torch, torch.utils.cpp_extension as cpp_extension
def no_build(*args, **kwargs):
    raise AssertionError("the kernel was compiled")
cpp_extension.load_inline = no_build
from minipd.kernels.cpu_paged_attention import load_kernel, paged_decode_attention_cpu
from minipd.kernels.paged_attention import paged_decode_attention_torch
module, why = load_kernel()
assert module is not None, why
g = torch.Generator().manual_seed(0)
q = torch.randn(2, 4, 16, generator=g)
k, v = torch.randn(2, 4, 8, 2, 16, generator=g)
tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([11, 16])
args = (q, k, v, tables, lens, 0.25, 0, torch.empty(0), torch.empty(0))
want = paged_decode_attention_torch(q, k, v, tables, lens, 0.25)
torch.testing.assert_close(torch.ops.minipd_cpu.paged_decode(*args), want, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(paged_decode_attention_cpu(q, k, v, tables, lens, 0.25), want, rtol=1e-5, atol=1e-5)
"""
    env = {**os.environ, cpu_paged_attention.NO_BUILD_ENV: "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
