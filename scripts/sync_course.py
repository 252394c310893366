"""Write the README's course table from ``minipd/course.py`` and the notebooks in ``chapters/`` (run it after
adding a chapter; ``tests/test_notebook_hygiene.py`` fails while the two disagree)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipd.course import course_table  # noqa: E402

START = "<!-- course table: scripts/sync_course.py writes it from minipd/course.py -->"
END = "<!-- end of course table -->"


def readme_with_table(readme: str, present: list[str]) -> str:
    """``readme`` with the text between the markers replaced by the current table."""
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{course_table(present)}\n{END}{tail}"


def present_chapters() -> list[str]:
    return [p.stem for p in sorted((ROOT / "chapters").glob("[0-9]*.ipynb"))]


if __name__ == "__main__":
    path = ROOT / "README.md"
    before = path.read_text()
    after = readme_with_table(before, present_chapters())
    if after != before:
        path.write_text(after)
        print("README.md: course table updated")
