"""Every exercise checker of every chapter, in its three states.

PASS on the package's reference solution, TODO on an untouched stub (``NotImplementedError``), and
FAIL — never an exception, which would break the reader's notebook — on any other wrong answer.
Each chapter's own test file plants the bugs specific to its exercises.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from minipd.exercises import ch01, ch02, ch03, ch03b, ch04, ch05, ch05b, ch06, ch07, ch08
from minipd.exercises.checking import TODO_MESSAGE

CHAPTERS: list[ModuleType] = [ch01, ch02, ch03, ch03b, ch04, ch05, ch05b, ch06, ch07, ch08]
EXERCISES = [(module, name.removeprefix("check_")) for module in CHAPTERS for name in dir(module)
             if name.startswith("check_") and hasattr(module, "reference_" + name.removeprefix("check_"))]
IDS = [f"{module.__name__.rsplit('.', 1)[1]}.{name}" for module, name in EXERCISES]


def stub(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def raises_other(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("a bug in the reader's code")


WRONG_ANSWERS = [raises_other, lambda *a, **k: None, lambda *a, **k: 1 / 0, "not a function", lambda *a, **k: "7"]


def test_every_chapter_has_exercises():
    assert {m for m, _ in EXERCISES} == set(CHAPTERS)
    assert len(EXERCISES) >= 20


@pytest.mark.parametrize(("module", "name"), EXERCISES, ids=IDS)
def test_reference_passes(module: ModuleType, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = getattr(module, f"check_{name}")(getattr(module, f"reference_{name}"))
    assert result.status == "PASS" and result.passed
    assert capsys.readouterr().out.strip() == f"PASS {name}"


@pytest.mark.parametrize(("module", "name"), EXERCISES, ids=IDS)
def test_untouched_stub_is_todo(module: ModuleType, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = getattr(module, f"check_{name}")(stub)
    assert result.status == "TODO" and not result.passed
    assert capsys.readouterr().out.strip() == f"TODO {name}: {TODO_MESSAGE}"


@pytest.mark.parametrize("bad", WRONG_ANSWERS, ids=["raises", "none", "zero-division", "not-callable", "string"])
@pytest.mark.parametrize(("module", "name"), EXERCISES, ids=IDS)
def test_wrong_answers_fail_without_raising(module: ModuleType, name: str, bad: Any) -> None:
    result = getattr(module, f"check_{name}")(bad)
    assert result.status == "FAIL" and result.message
