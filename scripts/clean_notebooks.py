"""Strip what should not be committed from executed notebooks: widget state and execution timing."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def clean(path: Path) -> bool:
    """Remove saved widget state and per-cell timing metadata; return True if the file changed."""
    nb = json.loads(path.read_text())
    before = json.dumps(nb, sort_keys=True)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        cell.get("metadata", {}).pop("execution", None)
    after = json.dumps(nb, sort_keys=True)
    if after != before:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return after != before


if __name__ == "__main__":
    for name in sys.argv[1:]:
        if clean(Path(name)):
            print(f"cleaned {name}")
