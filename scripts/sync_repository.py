"""Point the Binder and Colab badges and every chapter's Colab set-up cell at the repository in pyproject.toml.

The repository's address is a setting, ``[project.urls] Repository`` in ``pyproject.toml``; a fork
changes it there and runs ``python scripts/sync_repository.py``. ``--check`` only reports what
differs (the tests run it), exit status 1 when something does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The first code cell of every chapter: on Colab it clones the repository, installs it, and makes the
#: fresh editable install importable in the running kernel (which would otherwise need a restart).
SETUP_CELL = '''# Setup: on Colab this installs minipd from GitHub; anywhere else it does nothing.
import sys
if "google.colab" in sys.modules:
    !git clone -q --depth 1 {url} /content/minipd
    %pip install -q -e /content/minipd
    sys.path.insert(0, "/content/minipd")  # a fresh editable install is not on the running kernel's path
    %cd /content/minipd/chapters'''


def repository_url() -> str:
    """``[project.urls] Repository`` of pyproject.toml, e.g. ``https://github.com/minipd/minipd``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^Repository\s*=\s*"(https://github\.com/[^"/]+/[^"/]+)"', text, flags=re.MULTILINE)
    if match is None:
        raise SystemExit('pyproject.toml needs [project.urls] Repository = "https://github.com/OWNER/NAME"')
    return match.group(1)


def badges(url: str) -> tuple[str, str]:
    """The README's Binder and Colab badge lines for ``url``."""
    slug = url.removeprefix("https://github.com/")
    binder = (f"[![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/{slug}/main"
              "?urlpath=lab/tree/chapters/00_tour.ipynb)")
    colab = (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
             f"(https://colab.research.google.com/github/{slug}/blob/main/chapters/00_tour.ipynb)")
    return binder, colab


def sync(check: bool) -> list[str]:
    """Bring the README and the chapters in line with the setting; return what differed."""
    url = repository_url()
    differed = []
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    lines = readme.split("\n")
    for prefix, wanted in zip(("[![Binder]", "[![Open In Colab]"), badges(url), strict=True):
        index = next((i for i, line in enumerate(lines) if line.startswith(prefix)), None)
        if index is None or lines[index] != wanted:
            differed.append(f"README.md: the {prefix[3:-1]} badge")
            if index is not None:
                lines[index] = wanted
    if not check and "\n".join(lines) != readme:
        readme_path.write_text("\n".join(lines), encoding="utf-8")
    cell = SETUP_CELL.format(url=url)
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        setup = next((c for c in notebook["cells"] if c["cell_type"] == "code"), None)
        if setup is None or "".join(setup["source"]) != cell:
            differed.append(f"{path.relative_to(ROOT)}: the Colab set-up cell")
            if not check and setup is not None:
                setup["source"] = cell.splitlines(keepends=True)
                path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return differed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report what differs, change nothing")
    args = parser.parse_args(argv)
    differed = sync(args.check)
    for item in differed:
        print(("differs: " if args.check else "updated: ") + item)
    return 1 if differed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
