import os
import sys
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


@pytest.fixture(autouse=True)
def close_figures():
    """Close every matplotlib figure a test drew (without importing matplotlib for tests that never do)."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
