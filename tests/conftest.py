import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Tests never reach a model hub; everything they load is bundled or made here.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run under its interpreter; the flag must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
# Choices measured on this machine by `python -m minipd build-kernels` (linear path, one-thread step size) would
# change the engine's defaults under test: tests see none unless they write their own (in a folder of ours).
if "MINIPD_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="minipd-test-cache-")
    os.environ["MINIPD_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)


@pytest.fixture(autouse=True)
def close_figures():
    """Close every matplotlib figure a test drew (without importing matplotlib for tests that never do)."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
