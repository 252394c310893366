"""Compiled decode programs kept on disk (:mod:`minipd.engine.program_cache`): a later engine, or a later process,
loads them with nothing traced and gives the eager engine's tokens; the key follows what shapes a program and
nothing else; a wrong, damaged or unsafe file is not used.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.engine import program_cache

OPTIONS = dict(compile_decode=True, compile_warmup=True, compile_batch_sizes=(1, 2), max_model_len=32,
               max_num_seqs=2, kernel_backend="torch")
PROMPTS = ["def fib(n):", "import os\nclass Foo:"]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 5)]  # both buckets used


@pytest.fixture
def programs(tmp_path, monkeypatch):
    """A cache folder of this test's own; returns where programs go in it."""
    monkeypatch.setenv("MINIPD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(program_cache.ENV_SWITCH, raising=False)
    return tmp_path / "decode_programs"


@pytest.fixture(scope="module")
def eager_tokens():
    llm = LLM("tiny-py", max_model_len=32, max_num_seqs=2, kernel_backend="torch")
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _captured() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["calls_captured"]


def test_a_second_engine_loads_every_program_traces_nothing_and_gives_the_eager_tokens(programs, eager_tokens):
    first = LLM("tiny-py", **OPTIONS)
    compiled = first.engine.core.runner.compiled
    # (The torch attention gathers a bucketed table width: 2 batch sizes x 2 widths of 16-token blocks.)
    assert compiled.loaded == set() and len(compiled.compiled) == 4
    files = sorted(programs.glob("*.program"))
    assert sorted(compiled.program_files.values()) == files and len(files) == 4
    # Private files in a private folder: nobody else may write what will be unpickled.
    for path in (*files, programs):
        assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0
    assert _tokens(first) == eager_tokens

    for path in files:  # made to look old: loading them marks them used (the folder is trimmed by last use)
        os.utime(path, ns=(10**18, 10**18))
    captured = _captured()
    second = LLM("tiny-py", **OPTIONS)
    again = second.engine.core.runner.compiled
    assert again.loaded == again.compiled == compiled.compiled
    assert _captured() == captured  # loaded, not traced
    assert all(path.stat().st_mtime_ns > 10**18 for path in files)
    assert _tokens(second) == eager_tokens
    assert _captured() == captured


WARM_START = """
import json, sys
from minipd import LLM, SamplingParams
llm = LLM("tiny-py", **json.loads(sys.argv[1]))
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 5)]
tokens = [o.token_ids for o in llm.generate(json.loads(sys.argv[2]), params)]
from torch._dynamo.utils import counters
compiled = llm.engine.core.runner.compiled
print(json.dumps({"loaded": sorted(compiled.loaded), "compiled": sorted(compiled.compiled), "tokens": tokens,
                  "captured": counters["stats"]["calls_captured"]}))
"""


def test_a_new_process_loads_the_programs_an_earlier_one_kept(programs, eager_tokens):
    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", WARM_START, json.dumps(OPTIONS), json.dumps(PROMPTS)],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["loaded"] == [] and cold["captured"] >= 4 and len(cold["compiled"]) == 4
    assert warm["loaded"] == warm["compiled"] == cold["compiled"]
    assert warm["captured"] == 0  # the second process traced nothing
    assert cold["tokens"] == warm["tokens"] == eager_tokens


def _files_by_bucket(llm: LLM) -> dict:
    return dict(llm.engine.core.runner.compiled.program_files)


def test_a_wrong_or_damaged_program_is_traced_again_and_replaced(programs, eager_tokens, caplog, monkeypatch):
    files = _files_by_bucket(LLM("tiny-py", **OPTIONS))
    (wrong, wrong_file), (damaged, damaged_file) = sorted(files.items())[:2]
    written = wrong_file.stat().st_mtime_ns
    # A program that loads but is not this step (what a key that missed something would give): its probe
    # against the eager step shows it.
    load = program_cache.load

    def load_a_wrong_one(key, external):
        program = load(key, external)
        if key != wrong_file.stem or program is None:
            return program
        return lambda *args: (program(*args)[0] * 1.01, *program(*args)[1:])

    monkeypatch.setattr(program_cache, "load", load_a_wrong_one)
    damaged_file.write_bytes(b"not a program")  # and a damaged file: it does not load
    with caplog.at_level(logging.WARNING, logger="minipd"):
        llm = LLM("tiny-py", **OPTIONS)
    compiled = llm.engine.core.runner.compiled
    assert compiled.compiled == set(files) and compiled.loaded == set(files) - {wrong, damaged}
    assert f"the program kept for bucket {wrong} differs from the eager step" in caplog.text
    # Both traced again and kept in their places.
    assert wrong_file.stat().st_mtime_ns > written and damaged_file.stat().st_size > 1000
    assert _tokens(llm) == eager_tokens


def test_a_program_others_can_write_is_not_loaded(programs, eager_tokens, caplog):
    files = _files_by_bucket(LLM("tiny-py", **OPTIONS))
    bucket, path = sorted(files.items())[0]
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="minipd"):
        llm = LLM("tiny-py", **OPTIONS)
    assert bucket not in llm.engine.core.runner.compiled.loaded
    assert "can be written by another user" in caplog.text
    assert _tokens(llm) == eager_tokens


def test_switched_off_nothing_is_kept(programs, monkeypatch, eager_tokens):
    monkeypatch.setenv(program_cache.ENV_SWITCH, "0")
    llm = LLM("tiny-py", **OPTIONS)
    compiled = llm.engine.core.runner.compiled
    assert len(compiled.compiled) == 4 and compiled.loaded == set() and compiled.program_files == {}
    assert not programs.exists()
    assert _tokens(llm) == eager_tokens


def test_the_probe_rejects_a_program_whose_logits_differ(programs):
    compiled = LLM("tiny-py", **OPTIONS).engine.core.runner.compiled
    bucket = sorted(compiled.compiled)[0]

    def eager(decode, *args):
        return decode._forward(*args)

    def shifted(decode, *args):
        logits, *rest = decode._forward(*args)
        return (logits + 0.01, *rest)

    with torch.inference_mode():
        assert compiled._agrees_with_eager(eager, bucket)
        assert not compiled._agrees_with_eager(shifted, bucket)
        assert not compiled._agrees_with_eager(lambda *args: (None,) * 8, bucket)


def _model():
    return LLM("tiny-py", max_model_len=64).engine.core.model


def test_the_key_follows_what_shapes_a_program_not_the_weights():
    model = _model()
    parts = {"program": "test", "model": program_cache.describe_model(model)}
    key = program_cache.program_key(parts)
    assert program_cache.program_key(dict(parts)) == key  # the same from the same things
    assert program_cache.program_key({**parts, "model": program_cache.describe_model(_model())}) == key
    # Weights are read where they lie, not kept in the program: new values, same key.
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert program_cache.program_key({**parts, "model": program_cache.describe_model(model)}) == key
    # A module's plain attribute is traced into the program: a new key.
    norm = next(m for m in model.modules() if hasattr(m, "eps"))
    norm.eps = norm.eps * 10
    assert program_cache.program_key({**parts, "model": program_cache.describe_model(model)}) != key
    # So are the threads a CPU program is built for.
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)
    try:
        assert program_cache.program_key(parts) != key
    finally:
        torch.set_num_threads(before)


def test_describe_keeps_nothing_that_changes_between_processes():
    class Settings:
        def __init__(self):
            self.scale, self.name, self.table = 0.5, "x", torch.zeros(3, 4)
            self.lock = object()
            self.itself = self  # a cycle: cut by the depth

    described = program_cache.describe(Settings())
    assert described["scale"] == 0.5 and described["table"] == {"tensor": [[3, 4], [4, 1], "torch.float32", "cpu"]}
    assert described["lock"] == {"type": "object"} or described["lock"] == "object"
    assert "0x" not in json.dumps(described)
    assert program_cache.describe(Settings()) == described


def test_the_source_fingerprint_follows_contents_not_times(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"1")
    first = program_cache.folder_fingerprint(tmp_path)
    os.utime(tmp_path / "a.py", (1, 1))
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"2")
    assert program_cache.folder_fingerprint(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert program_cache.folder_fingerprint(tmp_path) != first


def test_the_folder_is_trimmed_least_recently_used_first_and_nothing_else_is_touched(programs, monkeypatch):
    programs.mkdir(parents=True)
    names = [f"{i:064x}.program" for i in range(4)]
    for age, name in enumerate(names):  # the first is the oldest
        path = programs / name
        path.write_bytes(b"x" * 1000)
        os.utime(path, ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    strangers = [programs / "notes.txt", programs / "abc.program"]
    for path in strangers:
        path.write_bytes(b"y" * 5000)
    removed = program_cache.trim(2500)
    assert [p.name for p in removed] == names[:2]
    assert sorted(p.name for p in programs.iterdir()) == sorted([*names[2:], "abc.program", "notes.txt"])
    assert program_cache.trim(2500) == []
    monkeypatch.setenv(program_cache.LIMIT_ENV, "1.5")
    assert program_cache.limit_bytes() == int(1.5 * 2**20)
    monkeypatch.setenv(program_cache.LIMIT_ENV, "lots")
    assert program_cache.limit_bytes() == 2048 * 2**20
