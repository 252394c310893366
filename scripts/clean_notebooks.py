"""Strip what should not be committed from executed notebooks: widget state, execution timing, and progress
bars drawn as widgets (a library's "Loading weights: 0%" is noise, not part of the chapter)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

#: tqdm's text form: "Loading weights:  40%|####      | 22/56 [...]".
PROGRESS_BAR = re.compile(r"\d+%\|")


def is_progress_widget(output: dict) -> bool:
    """A widget output whose text fallback is a progress bar."""
    data = output.get("data", {})
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    return "application/vnd.jupyter.widget-view+json" in data and bool(PROGRESS_BAR.search(text))


def clean(path: Path) -> bool:
    """Remove saved widget state and per-cell timing metadata; return True if the file changed."""
    nb = json.loads(path.read_text())
    before = json.dumps(nb, sort_keys=True)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        cell.get("metadata", {}).pop("execution", None)
        if "outputs" in cell:
            cell["outputs"] = [o for o in cell["outputs"] if not is_progress_widget(o)]
    after = json.dumps(nb, sort_keys=True)
    if after != before:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return after != before


if __name__ == "__main__":
    for name in sys.argv[1:]:
        if clean(Path(name)):
            print(f"cleaned {name}")
