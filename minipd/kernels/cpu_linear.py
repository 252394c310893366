"""Linear layers on the CPU with weights packed once at load: for oneDNN (``linear_backend="onednn"``, below)
or in panels for minipd's own C++ kernel (``linear_backend="cpu"``, :class:`PanelLinear`).

torch's default fp32 ``F.linear`` on a CPU calls MKL's sgemm, which on AMD processors runs a generic
AVX2 code path; oneDNN (bundled with torch, reachable through ``torch.ops.mkldnn``) has kernels for
the machine's real instruction set and a weight layout packed for them. Packing is done once per
weight, when the engine is built, so a step only multiplies. On this project's 2-core AMD EPYC
(AVX-512), one thread, the five linear shapes of tiny-py: oneDNN takes 0.43-0.52x MKL's time from 4 rows
up, but 1.2x at one row. There (a single stream's decode step) the fastest is a plain matrix product
against a transposed copy of the weight kept beside it: about 0.8x ``F.linear``'s matrix-vector path.
oneDNN's call is wrapped as a torch custom op, so a compiled decode step
(:mod:`minipd.engine.compiled_decode`) calls it whole.

The result is not bit-identical to MKL's (a different summation order: differences of about 1e-6
relative), which is why it is an engine option; the tests check that greedy outputs do not change.

minipd's panel kernel (:file:`cpu_panel_linear.cpp`, built with the attention kernels) keeps 16 output
features' weights interleaved by input, so a register block of up to 6 rows reads each weight once and
does 12 fused multiply-adds per 8 loads. It also takes bf16 and fp16 weights (a model loaded in that dtype),
widened to fp32 as they load: a decode step streams half the bytes, where torch's own bf16 product of a few
rows is several times slower than fp32. On the AVX2-only EPYC it beat oneDNN and MKL at every row count
(1 to 1,024): a decode row at memory speed, a batch at up to ~190 GFLOP/s on two cores, where oneDNN
reached ~160 and MKL ~180. Which path ``"auto"`` takes is measured per machine
(:mod:`minipd.kernels.measured`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minipd.kernels.measured import last_level_cache_bytes

#: Rows up to which an eager call multiplies against the transposed copy (MKL's and oneDNN's paths lose there).
SMALL_ROWS = 1
#: Rows up to which a *compiled* call is written as a multiply-and-sum the compiler generates itself
#: (see :func:`rows_linear`), while the model's linears fit in the CPU's last-level cache. Measured on the
#: 2-core AMD EPYC, the 24 linears of tiny-py, compiled: at 1 row 0.20 ms against oneDNN's 1.54 ms (2 threads),
#: at 8 rows 1.32 against 2.61, at 16 rows 1.85 against 2.39.
TRACED_SUM_ROWS = 16
#: The same when they do not fit: the loop reads the weight once per row, from memory. The 40 linears of a
#: 50M-parameter model (203 MB), the AVX2 EPYC (32 MiB cache), 2 threads: 2 rows 10.2 ms against oneDNN's 13.2,
#: 4 rows 19.9 against 16.6, 8 rows 45 against 17.8.
TRACED_SUM_ROWS_UNCACHED = 2


def onednn_available() -> bool:
    """Whether this torch build can pack and run oneDNN linears on the CPU."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@torch.library.custom_op("minipd::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` against a oneDNN-packed ``W``; a custom op so a compiled graph calls it whole
    (the compiler cannot lay out the packed weight itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def onednn_pack(weight: torch.Tensor, batch_size_hint: int = 64) -> torch.Tensor:
    """``weight`` laid out for oneDNN's packed product (:func:`onednn_multiply`), for batches of about
    ``batch_size_hint`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


def onednn_multiply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for a contiguous 2-D ``x`` against ``packed`` (:func:`onednn_pack`): the custom op while
    compiling, so the graph calls it whole; eagerly the op itself (a custom op's Python wrapper costs ~20 us a
    call)."""
    if torch.compiler.is_compiling():
        return onednn_linear(x, packed, bias, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows, written as an elementwise product summed over the inputs.

    Eagerly this would build a (rows, out, in) tensor; compiled, the compiler fuses it into one loop that
    streams the weight once and splits the outputs over the threads. For a decode step's few rows that
    reads the weight at cache/memory speed, where a BLAS matrix-vector call on a small matrix reaches a
    fraction of it and does not use a second thread.
    """
    out = (x[:, None, :] * weight[None]).sum(-1)
    return out if bias is None else out + bias


#: The weight dtypes minipd's panel kernel packs (oneDNN's packed linears take fp32 only).
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _RepackedLinear(nn.Module):
    """What the packed linears share: a CPU ``nn.Linear``'s own ``weight`` and ``bias`` tensors (tied
    embeddings, state dicts and weight readers see no difference), beside a copy laid out for a kernel."""

    #: The weight dtypes this kind of linear packs.
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu" or linear.weight.dtype not in self.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise ValueError(f"{type(self).__name__} packs {allowed} weights on the CPU; got "
                             f"{linear.weight.dtype} on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module],
                  dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Replace every CPU ``nn.Linear`` of ``model`` with weights of one of ``dtypes`` by ``make(linear)``; returns
    how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in dtypes:
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


class PackedLinear(_RepackedLinear):
    """An ``nn.Linear`` whose weight is also kept in oneDNN's packed layout and transposed; same parameters,
    same result up to summation order. ``weight`` and ``bias`` stay the original tensors (tied embeddings,
    state dicts and weight readers see no difference); the two copies cost the weight's size twice again."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int = 64) -> None:
        super().__init__(linear)
        #: Rows up to which a compiled call sums itself (:func:`pack_linears` sets it for the whole model).
        self.traced_sum_rows = TRACED_SUM_ROWS
        self.repack(batch_size_hint)

    def repack(self, batch_size_hint: int = 64) -> None:
        """Pack ``weight`` again (after it was changed in place)."""
        # Not parameters or buffers: derived from `weight`, rebuilt here if the weight changes.
        self.packed = onednn_pack(self.weight, batch_size_hint)
        self.weight_t = self.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        compiling = torch.compiler.is_compiling()
        if compiling and rows <= self.traced_sum_rows:  # shapes are fixed while tracing: decided per program
            out = rows_linear(flat, self.weight, self.bias)
        elif rows <= SMALL_ROWS:
            # A product against the transposed copy beats F.linear's matrix-vector path and oneDNN at one row.
            out = torch.mm(flat, self.weight_t)
            out = out if self.bias is None else out + self.bias
        else:
            out = onednn_multiply(flat.contiguous(), self.packed, self.bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


def panel_kernels() -> object | None:
    """The built C++ extension that carries :class:`PanelLinear`'s kernel, or None (nothing is compiled here:
    ``python -m minipd build-kernels`` builds it)."""
    from minipd.kernels.cpu_paged_attention import kernel_built, load_kernel

    if not kernel_built():
        return None
    module, _ = load_kernel()
    return module if module is not None and hasattr(module, "panel_linear") else None


def narrow_matmul_rows(dtype: torch.dtype) -> int | None:
    """Rows from which another product of ``dtype`` weights is faster than the panel kernel on this machine, as
    ``python -m minipd build-kernels`` measured it; None when not measured or never. For bf16 and fp16, torch's
    own product (CPUs with bf16 arithmetic, AVX512-BF16 or AMX, multiply large bf16 batches faster than any fp32
    kernel can); for fp32, oneDNN's packed one (a core with full-width AVX-512, such as AMD's Zen 5, runs it at
    about twice the panels' rate from 8 rows, while one decode row is as fast either way)."""
    from minipd.kernels.measured import measured_choice

    choice = measured_choice("narrow_matmul_rows")
    rows = choice.get(str(dtype).removeprefix("torch.")) if isinstance(choice, dict) else None
    return rows if isinstance(rows, int) and rows > 0 else None


class PanelLinear(_RepackedLinear):
    """An ``nn.Linear`` whose weight is also kept in panels of 16 output features for minipd's C++ kernel
    (``linear_backend="cpu"``, :file:`cpu_panel_linear.cpp`); same parameters, same result up to summation order.

    fp32, bf16 or fp16 weights: the panels keep the weight's dtype and the kernel widens them to fp32 as it
    loads them (inputs, products and sums in fp32, the result rounded once to the input's dtype). A bf16 or
    fp16 linear hands batches of ``matmul_rows`` rows and more to torch's own product, an fp32 one to oneDNN's
    packed product (:func:`pack_panel_linears` passes :func:`narrow_matmul_rows`, where that was measured faster:
    bf16 arithmetic in the CPU, or a core whose oneDNN kernels multiply wider than the panels').

    The kernel multiplies up to six rows by a panel in registers (twelve in an AVX-512 build, a panel's line
    one register, or sixteen when they are the whole batch), reading the weight once per block of rows, in
    order: one decode row streams it at memory speed, a batch runs at the FMA units' rate (on a Zen 5 EPYC, 2
    threads: the AVX-512 blocks 412 GFLOP/s against the AVX2 ones' 267; the 50M model's 41 linears at 16 rows
    4.85 ms as two blocks of 8 against 6.09 through oneDNN, and 4.64 ms against 5.21 once one block of 16).
    On the 2-core AVX2 EPYC, the 40 linears of a 50M-parameter model, 2 threads: 1 row 6.9 ms against oneDNN's
    9.8, 16 rows 13.8 against 19.2, 64 rows 41.6 against 51.1; and 175-195 GFLOP/s against oneDNN's 150-163 on
    prefill's 64-1,024 rows. ``weight`` and ``bias`` stay the original tensors (ties and state dicts unchanged);
    the panels cost the weight's size again (and an fp32 weight handed over to oneDNN, its packed layout once
    more).
    """

    dtypes = PANEL_DTYPES

    def __init__(self, linear: nn.Linear, module: object, matmul_rows: int | None = None) -> None:
        super().__init__(linear)
        # The extension's functions, not the module: a module object would not survive a deepcopy of the model.
        self._pack, self._multiply = module.pack_panels, module.panel_linear  # type: ignore[attr-defined]
        #: Rows from which the linear multiplies through another product instead (None: never): F.linear for
        #: bf16/fp16 weights, oneDNN's packed product for fp32 ones (which then keep that layout too).
        self.matmul_rows = None if linear.weight.dtype == torch.float32 and not onednn_available() else matmul_rows
        self.repack()

    def repack(self) -> None:
        """Pack ``weight`` again (after it was changed in place)."""
        # Not parameters or buffers: derived from `weight`, rebuilt here if the weight changes.
        self.panels = self._pack(self.weight.detach())
        to_onednn = self.matmul_rows is not None and self.weight.dtype == torch.float32
        self.packed = onednn_pack(self.weight) if to_onednn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.matmul_rows is not None and rows >= self.matmul_rows:
            if self.packed is None:
                return F.linear(x, self.weight, self.bias)
            out = onednn_multiply(x.reshape(rows, x.shape[-1]).contiguous(), self.packed, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        flat = x.reshape(rows, x.shape[-1])
        bias = None if self.bias is None else self.bias.detach()
        if torch.compiler.is_compiling():  # the dispatcher op: the compiled graph calls the kernel whole
            out = torch.ops.minipd_cpu.panel_linear(flat, self.panels, bias, self.out_features)
        else:  # the extension's own binding: the dispatcher's Python path costs more than a small call
            out = self._multiply(flat, self.panels, bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


def pack_panel_linears(model: nn.Module) -> int:
    """Replace every fp32, bf16 or fp16 CPU ``nn.Linear`` of ``model`` by a :class:`PanelLinear`; returns how many.

    Raises ``ValueError`` when the C++ kernels are not built."""
    module = panel_kernels()
    if module is None:
        raise ValueError("linear_backend='cpu' needs minipd's C++ CPU kernels: run `python -m minipd build-kernels` "
                         "(a C++ compiler and ninja), or use linear_backend='onednn' or 'torch'")
    # (The measured hand-over to another product, read once per dtype, not once per layer.)
    handover = {dtype: narrow_matmul_rows(dtype) for dtype in PANEL_DTYPES}
    return _swap_linears(model, lambda linear: PanelLinear(linear, module, handover.get(linear.weight.dtype)),
                         PANEL_DTYPES)


def traced_sum_rows(weight_bytes: int, cache_bytes: int | None) -> int:
    """Rows up to which compiled linears sum themselves, for linears of ``weight_bytes`` in all on a CPU whose
    last-level cache holds ``cache_bytes`` (None: unknown, taken as too small)."""
    return TRACED_SUM_ROWS if cache_bytes is not None and weight_bytes <= cache_bytes else TRACED_SUM_ROWS_UNCACHED


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`; returns how many. Each
    packed linear's ``traced_sum_rows`` follows whether all of the model's packed weights fit in the CPU's
    last-level cache (a step reads them all, so one matrix's re-reads come from the cache only if they do).

    Raises ``ValueError`` when this torch build has no oneDNN linear.
    """
    if not onednn_available():
        raise ValueError("linear_backend='onednn' needs a torch build with oneDNN (mkldnn) CPU kernels; "
                         "use linear_backend='torch'")
    swapped = _swap_linears(model, PackedLinear)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    weights = {id(m.weight): m.weight.numel() * m.weight.element_size() for m in packed}  # a tied weight once
    limit = traced_sum_rows(sum(weights.values()), last_level_cache_bytes())
    for module in packed:
        module.traced_sum_rows = limit
    return swapped


def unpack_linears(model: nn.Module) -> int:
    """Turn every :class:`PackedLinear` and :class:`PanelLinear` of ``model`` back into the plain ``nn.Linear``
    it packs (same weight and bias tensors, nothing copied); returns how many. An engine does this on its own
    view of a model another engine packed, so that its ``linear_backend`` is its own choice."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _RepackedLinear):
                plain = nn.Linear.__new__(nn.Linear)
                nn.Module.__init__(plain)
                plain.in_features, plain.out_features = child.in_features, child.out_features
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
                swapped += 1
    return swapped


__all__ = ["PANEL_DTYPES", "SMALL_ROWS", "TRACED_SUM_ROWS", "TRACED_SUM_ROWS_UNCACHED", "PackedLinear",
           "PanelLinear", "narrow_matmul_rows", "onednn_available", "onednn_multiply", "onednn_pack", "pack_linears",
           "pack_panel_linears", "panel_kernels", "rows_linear", "traced_sum_rows", "unpack_linears"]
