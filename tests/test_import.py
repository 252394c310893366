"""``import minipd`` stays light: no network and none of the heavy optional modules."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import socket, sys
def refuse(*args, **kwargs):
    raise AssertionError("import minipd touched the network")
socket.socket.connect = refuse
socket.create_connection = refuse
import torch
before = set(sys.modules)
import minipd
from minipd import LLM, SamplingParams, RequestOutput
new = set(sys.modules) - before
optional = {"transformers", "matplotlib", "triton", "ipywidgets", "huggingface_hub"}
heavy = sorted(m for m in new if m.split(".")[0] in optional)
print(heavy)
"""


def test_import_is_light_and_offline():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_scheduler_and_block_manager_import_without_torch():
    """A simulator drives them (and the step loop) with no model: importing them must not pull in torch."""
    import subprocess
    import sys

    code = ("import sys; import minipd.engine.scheduler, minipd.kv.block_manager, minipd.engine.request, "
            "minipd.engine.step_core; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
