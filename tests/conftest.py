import os
import sys
from pathlib import Path

# Tests never reach a model hub; everything they load is bundled or made here.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))
