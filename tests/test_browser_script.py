"""The browser test's pure parts (no browser, no JupyterLab): `make test` stays browser-free."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("browser_test", ROOT / "scripts" / "browser_test.py")
bt = importlib.util.module_from_spec(_spec)
sys.modules["browser_test"] = bt  # dataclasses look their module up while the class is made
_spec.loader.exec_module(bt)


def test_free_port_can_be_bound():
    port = bt.free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_chapter_list_is_every_notebook_in_order():
    chapters = bt.list_chapters()
    assert chapters, "no chapters found"
    assert [p.name for p in chapters] == sorted(p.name for p in (ROOT / "chapters").glob("*.ipynb"))
    assert chapters[0].stem == "00_tour"
    # every chapter with a slider to move is one of them
    assert set(bt.SLIDERS) <= {p.stem for p in chapters}


def test_chapter_list_skips_hidden_and_scratch_files(tmp_path):
    for name in ("01_b.ipynb", "00_a.ipynb", ".hidden.ipynb", "_scratch_01_b.ipynb", "notes.md"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in bt.list_chapters(tmp_path)] == ["00_a.ipynb", "01_b.ipynb"]


def test_select_chapters_by_name_or_prefix():
    chapters = [Path(f"chapters/{n}.ipynb") for n in ("00_tour", "03_kv_cache", "03b_paged", "04_batching")]
    assert bt.select_chapters(chapters, []) == chapters
    assert [p.stem for p in bt.select_chapters(chapters, ["03"])] == ["03_kv_cache", "03b_paged"]
    assert [p.stem for p in bt.select_chapters(chapters, ["03_", "chapters/04_batching.ipynb"])] == [
        "03_kv_cache", "04_batching"]
    with pytest.raises(ValueError, match="09"):
        bt.select_chapters(chapters, ["09"])


def test_strip_outputs_leaves_the_original_alone():
    nb = {"metadata": {"widgets": {"state": {}}, "kernelspec": {"name": "python3"}},
          "cells": [{"cell_type": "code", "execution_count": 3, "source": "1", "metadata": {},
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": "1"}]},
                    {"cell_type": "markdown", "source": "# hi", "metadata": {}}]}
    before = json.dumps(nb, sort_keys=True)
    out = bt.strip_outputs(nb)
    assert json.dumps(nb, sort_keys=True) == before
    assert out["cells"][0]["outputs"] == [] and out["cells"][0]["execution_count"] is None
    assert out["cells"][1] == nb["cells"][1]
    assert "widgets" not in out["metadata"] and out["metadata"]["kernelspec"] == {"name": "python3"}


@pytest.mark.parametrize(("output", "error"), [
    ({"output_type": "error", "ename": "ValueError", "evalue": "x", "traceback": []}, True),
    ({"output_type": "stream", "name": "stderr",
      "text": ["Traceback (most recent call last):\n", '  File "x.py"\n', "KeyError: 1\n"]}, True),
    # warnings, logging and progress bars write to stderr too: not failures
    ({"output_type": "stream", "name": "stderr", "text": "/x.py:3: UserWarning: careful\n  warn()\n"}, False),
    ({"output_type": "stream", "name": "stderr", "text": "100%|██████████| 8/8 [00:01<00:00,  5.1it/s]"}, False),
    ({"output_type": "stream", "name": "stderr", "text": "ERROR:minipd:worker 1 died (EngineDeadError)\n"}, False),
    ({"output_type": "stream", "name": "stdout", "text": "Traceback (most recent call last): printed on purpose"},
     False),
    ({"output_type": "display_data", "data": {"text/plain": "ValueError"}}, False),
    ({"output_type": "execute_result", "data": {"text/plain": "1"}, "execution_count": 1}, False),
])
def test_error_output_classification(output, error):
    assert bt.is_error_output(output) is error


def test_error_text_ignores_ansi_colours():
    assert bt.is_error_text("\x1b[0;31mTraceback (most recent call last)\x1b[0m\n...")
    assert bt.is_error_text("ZeroDivisionError   Traceback (most recent call last)\nCell In[2], line 1")
    assert not bt.is_error_text("/x.py:3: RuntimeWarning: overflow\n")


def test_describe_error_strips_ansi_and_keeps_the_end():
    out = {"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero",
           "traceback": ["\x1b[0;31m----\x1b[0m", "\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"]}
    assert bt.describe_error(out) == "----\nZeroDivisionError: division by zero"
    long = {"output_type": "stream", "name": "stderr", "text": "x" * 100 + "END"}
    assert bt.describe_error(long, limit=10).endswith("xxxxxxxEND")


def test_summary_lines():
    ok = bt.Result("00_tour", seconds=12.34, ok=True, cells="13/13")
    bad = bt.Result("03_kv_cache", seconds=5.0, ok=False, cells="2/39", detail=["error output\nmore"])
    lines = bt.summary_lines([ok, bad], 20.0)
    assert "00_tour" in lines[1] and "12.3" in lines[1] and "PASS" in lines[1]
    assert "FAIL" in lines[2] and "error output" in lines[2] and "more" not in lines[2]
    assert "FAIL" in lines[-1] and "1/2" in lines[-1]
    assert "PASS" in bt.summary_lines([ok], 1.0)[-1]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_child_pids_finds_grandchildren():
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(p.pid, flush=True)\ntime.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        assert grandchild in bt.child_pids(os.getpid())
        assert bt.child_pids(parent.pid) == [grandchild]
    finally:
        for pid in bt.child_pids(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
