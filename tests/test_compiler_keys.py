"""Inductor's source hashes kept between processes (minipd.engine.compiler_keys): stored once, handed back to
the next process, and computed afresh when the install changes or the store is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from minipd.engine.compiler_keys import install_fingerprint

# Prints what priming did and the key inductor then holds (the value any cache lookup would use).
SCRIPT = """
import base64, json
from minipd.engine.compiler_keys import prime_compiler_keys
outcome = prime_compiler_keys()
from torch._inductor import codecache
print(json.dumps({"outcome": outcome, "torch_key": base64.b64encode(codecache.torch_key()).decode()}))
"""


def _prime(cache_dir: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MINIPD_CACHE_DIR": cache_dir})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fingerprint_follows_every_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    source = tmp_path / "pkg" / "mod.py"
    source.write_text("x = 1\n")
    first = install_fingerprint(str(tmp_path))
    assert install_fingerprint(str(tmp_path)) == first
    source.write_text("x = 2\n")
    later = time.time() + 5
    os.utime(source, (later, later))
    assert install_fingerprint(str(tmp_path)) != first
    edited = install_fingerprint(str(tmp_path))
    (tmp_path / "pkg" / "new.py").write_text("")
    assert install_fingerprint(str(tmp_path)) != edited


def test_keys_are_stored_reused_and_recomputed_when_stale(tmp_path):
    first = _prime(str(tmp_path))
    assert first["outcome"]["torch_key"] == "computed"
    stored = json.loads((tmp_path / "compiler_keys.json").read_text())
    (entry,) = stored["torch_key"].values()
    assert entry["value"]["bytes"] == first["torch_key"]  # what inductor computed, byte for byte

    second = _prime(str(tmp_path))
    assert second["outcome"]["torch_key"] == "stored" and second["torch_key"] == first["torch_key"]

    # A store from another install (its fingerprint differs) is not believed: the key is computed again.
    entry["fingerprint"], entry["value"]["bytes"] = "another install", "AAAA"
    (tmp_path / "compiler_keys.json").write_text(json.dumps(stored))
    third = _prime(str(tmp_path))
    assert third["outcome"]["torch_key"] == "computed" and third["torch_key"] == first["torch_key"]
