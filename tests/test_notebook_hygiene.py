"""What a stored chapter must not carry: authoring notes, a library's progress bars saved as widgets, this
machine's paths; and the README's course table must list every chapter there is, each with its link."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from clean_notebooks import is_progress_widget  # noqa: E402

CHAPTERS_FILES = sorted((ROOT / "chapters").glob("[0-9]*.ipynb"))
#: Words that belong to whoever wrote the chapter, not to its reader ("the lead's section", "TODO: ...").
AUTHORING = re.compile(r"\b(TODO|FIXME|XXX)\b|\bthe lead\b|\blead's\b")
#: Paths of the machine a notebook was executed on.
LOCAL_PATH = re.compile(r"(/work/|/root/|/home/[a-z]|/tmp/[a-z])")


def cells_before_exercises(nb: dict) -> list[dict]:
    """The cells before the exercises (whose stubs and checkers talk of TODO by design)."""
    out = []
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and re.search(r"^## Exercises", text, re.M):
            out.append({**cell, "source": text.split("## Exercises")[0]})
            break
        out.append(cell)
    return out


def output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    data = output.get("data", {})
    text = data.get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


@pytest.mark.parametrize("path", CHAPTERS_FILES, ids=[p.stem for p in CHAPTERS_FILES])
def test_a_chapter_carries_no_authoring_notes_progress_bars_or_local_paths(path):
    nb = json.loads(path.read_text())
    for index, cell in enumerate(cells_before_exercises(nb)):
        found = AUTHORING.search("".join(cell["source"]))
        assert not found, f"{path.name} cell {index}: {found.group(0)!r} is an authoring note"
    for index, cell in enumerate(nb["cells"]):
        for output in cell.get("outputs", []):
            assert not is_progress_widget(output), f"{path.name} cell {index}: a progress bar saved as a widget"
            found = LOCAL_PATH.search(output_text(output))
            assert not found, f"{path.name} cell {index}: the output names a local path ({found.group(0)}...)"


def test_the_checks_see_what_they_look_for():
    bar = {"data": {"application/vnd.jupyter.widget-view+json": {}, "text/plain": "Loading weights:   0%|   | 0/56"}}
    assert is_progress_widget(bar) and not is_progress_widget({"data": {"text/plain": "0%|"}})
    assert AUTHORING.search("the lead's expert-parallel section") and AUTHORING.search("TODO: plot")
    assert not AUTHORING.search("prefill leads to a misleading spike")


def test_the_readme_table_and_the_tour_map_come_from_the_course_list():
    from sync_course import readme_with_table

    from minipd.course import CHAPTERS, chapters_present, course_table

    present = [p.stem for p in CHAPTERS_FILES]
    assert chapters_present() == present
    assert set(present) <= {ch.stem for ch in CHAPTERS}, "a chapter is missing from minipd/course.py"
    readme = (ROOT / "README.md").read_text()
    assert readme_with_table(readme, present) == readme, "README's course table is stale: python scripts/sync_course.py"
    linked = re.findall(r"^\| \[([0-9][0-9a-z_]*)\]\(chapters/\1\.ipynb\) \|", course_table(present), re.M)
    assert linked == present
    tour = json.loads((ROOT / "chapters" / "00_tour.ipynb").read_text())
    assert any("course_table()" in "".join(c["source"]) for c in tour["cells"] if c["cell_type"] == "code")
