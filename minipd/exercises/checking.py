"""The machinery behind every exercise checker: run the reader's function, compare, report.

A checker never raises and never passes an untouched stub. It returns one :class:`CheckResult`
in one of three states:

- ``PASS``: every case matched the reference within tolerance;
- ``FAIL``: a wrong value, shape or dtype, or an exception other than ``NotImplementedError``,
  with the largest difference and the first place where the answers part;
- ``TODO``: the function still raises ``NotImplementedError``, i.e. the stub is untouched.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Status = Literal["PASS", "FAIL", "TODO"]

#: What a TODO says; one wording everywhere, so readers learn to recognise it.
TODO_MESSAGE = "the stub still raises NotImplementedError"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one checker run.

    ``max_diff`` is the largest absolute difference seen (``inf`` where one side is infinite or
    NaN and the other is not); ``first_mismatch`` is the first differing index of a tensor, or the
    first differing position of a token sequence.
    """

    status: Status
    name: str
    message: str = ""
    max_diff: float | None = None
    first_mismatch: tuple[int, ...] | int | None = None

    @property
    def passed(self) -> bool:
        """True only for PASS."""
        return self.status == "PASS"

    def __str__(self) -> str:
        return f"{self.status} {self.name}" + (f": {self.message}" if self.message else "")


@dataclass(frozen=True)
class Case:
    """One input to a checked function: positional ``args``, a ``label`` for messages, tolerances.

    ``atol``/``rtol`` override the checker's defaults for this case (e.g. looser for bf16 inputs).
    """

    label: str
    args: tuple[Any, ...]
    atol: float | None = None
    rtol: float | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def report(result: CheckResult) -> CheckResult:
    """Print ``result`` (so it shows under the notebook cell) and hand it back."""
    print(result)
    return result


def todo(name: str) -> CheckResult:
    """The result for a function that still raises ``NotImplementedError``."""
    return CheckResult("TODO", name, TODO_MESSAGE)


def describe_exception(err: BaseException) -> str:
    """``TypeError: message (line 7 in fn)``: the type, message and innermost frame, without paths."""
    text = f"{type(err).__name__}: {err}".rstrip(": ")
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        last = frames[-1]
        # Only the function and line: file names of notebook cells are long temporary paths.
        text += f" (line {last.lineno} in {last.name})"
    return text


def call_reader(name: str, fn: Callable[..., Any], case: Case) -> tuple[Any, CheckResult | None]:
    """Call ``fn`` on ``case``; return its value, or a TODO/FAIL result instead if it raised."""
    if not callable(fn):
        return None, CheckResult("FAIL", name, f"expected a function, got {type(fn).__name__}")
    try:
        return fn(*_clone(case.args), **_clone(case.kwargs)), None
    except NotImplementedError:
        return None, todo(name)
    except Exception as err:  # the reader's bug, whatever it is, becomes a FAIL rather than a crash
        return None, CheckResult("FAIL", name, f"raised {describe_exception(err)} [case: {case.label}]")


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float
                    ) -> tuple[bool, float, tuple[int, ...] | None]:
    """Whether ``actual`` matches ``expected`` elementwise; the max |diff| and first mismatching index.

    Shapes must already agree. Equal infinities (e.g. -inf in a filtered logit) count as equal; a NaN
    anywhere the reference has a number counts as an infinite difference. Boolean tensors must
    match exactly.
    """
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if e.dtype == torch.bool:
        mismatch = a.bool() != e
        diff = mismatch.double()
    else:
        a64, e64 = a.double(), e.double()
        diff = (a64 - e64).abs()
        diff = torch.where(torch.isinf(e64) & (a64 == e64), torch.zeros_like(diff), diff)
        diff = torch.where(torch.isnan(diff), math.inf, diff)
        tol = torch.where(torch.isfinite(e64), atol + rtol * e64.abs(), torch.zeros_like(e64))
        mismatch = ~(diff <= tol)
    max_diff = float(diff.max()) if diff.numel() else 0.0
    if not bool(mismatch.any()):
        return True, max_diff, None
    first = tuple(int(i) for i in torch.nonzero(mismatch)[0]) if mismatch.dim() else ()
    return False, max_diff, first


def _format_value(t: torch.Tensor, index: tuple[int, ...]) -> str:
    value = t.detach().cpu()[index].item()
    return repr(value) if isinstance(value, bool) else f"{value:.4g}"


def check_tensor_fn(
    name: str,
    fn: Callable[..., Any],
    reference: Callable[..., torch.Tensor],
    make_inputs: Callable[[torch.Generator], Sequence[Case]],
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
) -> CheckResult:
    """Check a reader's tensor function against ``reference`` on every case ``make_inputs`` builds.

    ``make_inputs`` receives a generator seeded with ``seed``, so every run sees the same inputs,
    and should include edge cases (one token, a zero row, a low-precision dtype, ...). Both
    functions get their own copy of each input, so one modifying its arguments cannot affect the
    other. Returns TODO, FAIL or PASS as described in this module; never raises.
    """
    try:
        cases = list(make_inputs(torch.Generator().manual_seed(seed)))
    except Exception as err:  # a broken checker must still not break the notebook
        return CheckResult("FAIL", name, f"the checker could not build its inputs: {describe_exception(err)}")
    worst = 0.0
    for case in cases:
        expected = reference(*_clone(case.args), **_clone(case.kwargs))
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return failure
        case_atol = atol if case.atol is None else case.atol
        case_rtol = rtol if case.rtol is None else case.rtol
        failure, max_diff = tensor_mismatch(name, actual, expected, case_atol, case_rtol, f"[case: {case.label}]")
        if failure is not None:
            return failure
        worst = max(worst, max_diff)
    return CheckResult("PASS", name, max_diff=worst)


def tensor_mismatch(name: str, actual: Any, expected: torch.Tensor, atol: float, rtol: float, where: str,
                    subject: str = "") -> tuple[CheckResult | None, float]:
    """``(None, max |diff|)`` if ``actual`` is a tensor of ``expected``'s shape and dtype within the tolerances,
    else the FAIL saying what differs first. ``subject`` names the tensor in the message (``"codes:"``);
    without it the message speaks of what the function returned."""
    lead = subject or "returned"
    if not isinstance(actual, torch.Tensor):
        return CheckResult("FAIL", name, f"{lead} {type(actual).__name__}, expected a torch.Tensor {where}"), 0.0
    if actual.shape != expected.shape:
        return CheckResult("FAIL", name, f"{lead} shape {tuple(actual.shape)}, expected "
                                         f"{tuple(expected.shape)} {where}"), 0.0
    if actual.dtype != expected.dtype:
        return CheckResult("FAIL", name, f"{lead} dtype {actual.dtype}, expected {expected.dtype} {where}"), 0.0
    ok, max_diff, first = compare_tensors(actual, expected, atol, rtol)
    if ok:
        return None, max_diff
    assert first is not None
    got, want = _format_value(actual, first), _format_value(expected, first)
    message = (f"{subject + ' ' if subject else ''}max |diff| {max_diff:.3g}; first mismatch at index {first}: "
               f"got {got}, expected {want} {where}")
    return CheckResult("FAIL", name, message, max_diff=max_diff, first_mismatch=first), max_diff


def _clone(value: Any) -> Any:
    """A deep-enough copy of case arguments: tensors cloned, containers rebuilt, the rest shared."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


@contextmanager
def shadowed(obj: Any, **methods: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, each named method of ``obj`` is the given function (an instance attribute
    shadows the class's method); afterwards the class's again, whatever happened (deleting the
    instance attribute brings it back)."""
    for name, fn in methods.items():
        setattr(obj, name, fn)
    try:
        yield
    finally:
        for name in methods:
            obj.__dict__.pop(name, None)
