"""How readers get the course: Binder installs from pyproject (nothing listed twice), and every badge and
Colab set-up cell points at the repository pyproject names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_badges_and_colab_cells_follow_the_repository_setting():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sync_repository.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_binder_installs_minipd_with_its_dependencies_from_pyproject():
    requirements = [line.strip() for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
    # Only the CPU build of torch is chosen here (to keep the image small); nothing else is repeated.
    assert requirements == ["--extra-index-url https://download.pytorch.org/whl/cpu", "torch>=2.5"]
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert 'pip install -e ".[lab]"' in post_build and "--no-deps" not in post_build
    dependencies = re.search(r"dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S).group(1)
    assert "triton" in dependencies and "pyzmq" in dependencies  # what chapters 03b and 05 import
    assert '"ipywidgets>=7.6"' in dependencies  # Colab's ipywidgets 7 must not be upgraded away
