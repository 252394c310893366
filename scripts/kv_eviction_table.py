"""Chapter 06's eviction table, measured once and stored: each press at a 64-token budget on tiny-py (and int8
with the window), scored token by token as the text streams in (one token per step, so eviction happens as it
would while decoding). That takes ~40 s on two cores, most of a chapter's time budget; the chapter loads this
file, reruns the reference and one press live, and checks them against it.

    python scripts/kv_eviction_table.py --out assets/kv/eviction_quality.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from minipd.evaluation.kv_quality import measure
from minipd.kernels.measured import cpu_description

#: What the chapter measures (its live check uses the same settings for the reference and one press).
MODEL = "tiny-py"
METHODS = ["sink-window:64", "knorm:64", "h2o:64", "snapkv:64", "random:64", "int8+sink-window:64"]
SETTINGS = dict(num_windows=1, greedy_prompts=1, greedy_tokens=64, num_probes=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    reports = measure(MODEL, METHODS, **SETTINGS)
    import torch

    out = {"model": MODEL, "methods": METHODS, "settings": SETTINGS, "torch": torch.__version__,
           "python": platform.python_version(), "machine": cpu_description()["cpu"],
           "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - start, 1),
           "reports": [dataclasses.asdict(r) for r in reports]}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
