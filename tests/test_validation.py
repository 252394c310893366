"""Bad input is refused up front: a ``ValueError`` naming the field and what it allows, before any work.

Covers SamplingParams, EngineConfig, prompts, ``LLM(...)`` arguments, device and dtype, damaged model
folders (each error names the file), and the command line (one ``error:`` line, never a traceback).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minipd import LLM, SamplingParams
from minipd.cli import main
from minipd.device import resolve_device, resolve_dtype
from minipd.engine.config import EngineConfig
from minipd.engine.scheduler import PrefillFirst
from minipd.errors import ParameterError
from minipd.models.loading import load_model
from minipd.models.registry import bundled_models_dir
from minipd.models.weights import checkpoint_files

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@contextlib.contextmanager
def refused(param: str | None, match: str):
    """Expect a :class:`ParameterError` (a ``ValueError``) matching ``match`` whose ``param`` is ``param``
    (None: any field the message names), as a server filling OpenAI's ``param`` needs."""
    with pytest.raises(ParameterError, match=match) as err:
        yield err
    named = err.value.param
    assert named == param if param is not None else (named and named in str(err.value)), named
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")


@pytest.fixture(scope="module")
def llm():
    # A small pool: these tests generate a few tokens at a time.
    return LLM("tiny-py", device="cpu", seed=0, num_kv_blocks=32)


@pytest.fixture
def model_copy(tmp_path) -> Path:
    """A copy of the bundled tiny-py folder that a test may damage."""
    folder = tmp_path / "tiny-py-copy"
    folder.mkdir()
    for name in MODEL_FILES:
        shutil.copy(bundled_models_dir() / "tiny-py" / name, folder / name)
    return folder


def still_generates(llm: LLM) -> None:
    out = llm.generate("def add", GREEDY)
    assert len(out) == 1 and len(out[0].token_ids) == 4


# ------------------------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_p=True), "top_p"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=2**63), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(max_tokens=8.0), "max_tokens"),
        (dict(seed=True), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(stop=5), "stop"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop=b"\n"), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids="12"), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_refuses(kwargs, field):
    (value,) = kwargs.values()
    with refused(field, rf"^{field} must .*got {re.escape(repr(value))}$"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edge_values_as_plain_python_numbers():
    # A top_k beyond any vocabulary just means every token; seeds span signed and unsigned 64 bits.
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), max_tokens=np.int32(3),
                       stop=("a", "b"), stop_token_ids=(np.int64(2),), seed=np.uint64(7))
    assert (p.temperature, p.top_k, p.max_tokens, p.stop_strings, p.stop_token_ids, p.seed) == (
        0.5, 5, 3, ["a", "b"], [2], 7)
    assert all(type(v) is int for v in (p.top_k, p.max_tokens, p.stop_token_ids[0], p.seed))
    assert type(p.temperature) is float


def test_negative_seed_wraps_like_torch(llm):
    def sample(seed):
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
        return llm.generate("import", params)[0].token_ids

    assert sample(-1) == sample(2**64 - 1)
    assert sample(2**64 - 1) != sample(2**64 - 2)


# ------------------------------------------------------------------------------------ EngineConfig
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("block_size", True),
        ("num_kv_blocks", True),
        ("max_num_seqs", True),
        ("max_num_batched_tokens", True),
        ("kv_cache_memory", True),
        ("kv_cache_memory", 1.5e6 + 0.5),
        ("kv_cache_memory", math.nan),
        ("kv_cache_memory", math.inf),
        ("kv_cache_memory", "1GB"),
        ("enable_prefix_caching", 1),
        ("enable_prefix_caching", "yes"),
        ("kernel_backend", 1),
        ("kernel_backend", "cuda"),
    ],
)
def test_engine_config_refuses(option, value):
    with refused(option, rf"^{option} must .*got {re.escape(repr(value))}$"):
        EngineConfig(**{option: value})


@pytest.mark.parametrize("policy", [123, "random", None, PrefillFirst])
def test_scheduling_policy_refused_names_the_allowed_ones(policy):
    with refused("scheduling_policy", r"^scheduling_policy must be one of") as err:
        EngineConfig(scheduling_policy=policy)
    assert all(name in str(err.value) for name in ("'decode-first'", "'fcfs'", "'prefill-first'", "SchedulingPolicy"))
    if policy is PrefillFirst:
        assert "instance, not the class" in str(err.value)


def test_engine_config_accepts_whole_float_memory_numpy_ints_and_policy_objects():
    config = EngineConfig(kv_cache_memory=1e6, block_size=np.int64(8), scheduling_policy=PrefillFirst(),
                          kernel_backend="torch", enable_prefix_caching=False)
    assert config.kv_cache_memory == 1_000_000 and type(config.kv_cache_memory) is int
    assert config.block_size == 8 and type(config.block_size) is int
    assert EngineConfig(scheduling_policy="fcfs").scheduling_policy == "fcfs"


def test_engine_options_are_checked_before_the_model_is_looked_up():
    # The model does not exist; the option error comes first, so nothing was read or loaded.
    with refused("block_size", r"^block_size must"):
        LLM("no-such-model", block_size=True)


# ------------------------------------------------------------------------------------ prompts
@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (b"def add", r"^prompts must be .*got bytes \(decode it"),
        (bytearray(b"def"), r"^prompts must be .*got bytearray"),
        (["ok", b"def"], r"^prompts\[1\] must be a string or a list of token ids, got bytes"),
        ([1, True, 3], r"^prompts\[0\] has token id True \(bool\)"),
        (["ok", [5, False]], r"^prompts\[1\] has token id False \(bool\)"),
        ([[5, 6.0]], r"^prompts\[0\] has token id 6.0 \(float\)"),
        ([["a"]], r"^prompts\[0\] has token id 'a' \(str\)"),
        (np.array([5, 6]), r"^prompts must be .*got ndarray"),
    ],
)
def test_bad_prompts_are_refused_and_the_llm_keeps_working(llm, prompts, message):
    with refused(None, message):
        llm.generate(prompts, GREEDY)
    still_generates(llm)


def test_numpy_token_ids_are_plain_ints(llm):
    ids = [5, 6, 7]
    out = llm.generate([[np.int64(t) for t in ids]], GREEDY)[0]
    assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
    single = llm.generate(list(np.array(ids, dtype=np.int32)), GREEDY)
    assert len(single) == 1 and single[0].token_ids == out.token_ids


def test_sampling_params_of_the_wrong_type_are_refused(llm):
    with refused("sampling_params", r"^sampling_params must be .*got int"):
        llm.generate("x", 5)
    still_generates(llm)


# ------------------------------------------------------------------------------------ LLM(...) arguments
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_model_len=True), "max_model_len"),
        (dict(max_model_len=64.5), "max_model_len"),
        (dict(max_model_len=64.0), "max_model_len"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(max_model_len="64"), "max_model_len"),
        (dict(seed=True), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed="0"), "seed"),
    ],
)
def test_llm_arguments_are_checked_before_loading(kwargs, field):
    (value,) = kwargs.values()
    # "no-such-model" would fail later: the argument must be refused first.
    with refused(field, rf"^{field} must .*got {re.escape(repr(value))}$"):
        LLM("no-such-model", **kwargs)


def test_max_model_len_beyond_the_context_names_the_limit():
    with refused("max_model_len", r"^max_model_len must be in \[2, 1024\] for this model, got 1025"):
        LLM("tiny-py", device="cpu", max_model_len=1025)


def test_device_the_machine_lacks_is_refused_before_loading():
    with refused("device", r"^device 'cuda:99'.*available here: cpu"):
        LLM("no-such-model", device="cuda:99")


# ------------------------------------------------------------------------------------ device and dtype
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", r"^device 'tpu' is not a device name \(available here: cpu"),
        ("", r"^device '' is not a device name"),
        ("cuda:x", r"^device 'cuda:x' is not a device name"),
        ("meta", r"^device 'meta' is not available; minipd runs on cpu, cuda or mps"),
        (0, r"^device must be None, a string .*got int"),
    ],
)
def test_resolve_device_refuses_garbage(device, message):
    with refused("device", message):
        resolve_device(device)


def test_resolve_device_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with refused("device", r"needs CUDA, which this machine lacks \(available here: cpu\)$"):
            resolve_device(device)
    with refused("device", r"^device 'mps' is not available.*\(available here: cpu\)$"):
        resolve_device("mps")


def test_resolve_device_with_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_device("cuda") == torch.device("cuda")
    with refused("device", r"^device 'cuda:7': this machine has 1 CUDA device\(s\) "
                                         r"\(available here: cpu, cuda:0"):
        resolve_device("cuda:7")


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (None, torch.float32), ("auto", torch.float32), (torch.float16, torch.float16),
        ("float32", torch.float32), ("fp32", torch.float32), ("float16", torch.float16), ("fp16", torch.float16),
        ("half", torch.float16), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("BF16", torch.bfloat16),
    ],
)
def test_resolve_dtype_accepts(dtype, expected):
    assert resolve_dtype(dtype, "cpu") is expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "fp8", "torch.float16", 16, True])
def test_resolve_dtype_refuses(dtype):
    allowed = r"'auto', 'float32', 'fp32', 'float', 'float16', 'fp16', 'half', 'bfloat16', 'bf16', torch.float32"
    with refused("dtype", rf"^dtype must be None or one of {allowed}.*got {re.escape(repr(dtype))}$"):
        resolve_dtype(dtype, "cpu")


def test_load_model_takes_dtype_names():
    model, _ = load_model("tiny-py", device="cpu", dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------ damaged model folders
def config_error(folder: Path) -> str:
    with pytest.raises(ValueError) as err:
        LLM(folder, device="cpu")
    assert str(folder / "config.json") in str(err.value)
    return str(err.value)


def test_config_that_is_not_json_names_the_file(model_copy):
    (model_copy / "config.json").write_text('{"model_type": "llama", "hidden_size": 25')
    assert "is not valid JSON" in config_error(model_copy)
    (model_copy / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    assert "is not valid JSON" in config_error(model_copy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(hidden_size=None), "required field 'hidden_size' is missing"),
        (dict(vocab_size=True), "field 'vocab_size' must be a positive integer, got True"),
        (dict(num_hidden_layers="6"), "field 'num_hidden_layers' must be a positive integer, got '6'"),
        (dict(head_dim=0), "field 'head_dim' must be a positive integer, got 0"),
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    ],
)
def test_config_with_bad_fields_names_the_file_and_the_field(model_copy, change, message):
    path = model_copy / "config.json"
    raw = json.loads(path.read_text())
    for key, value in change.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    assert config_error(model_copy).startswith(f"{path}: {message}")


def test_config_that_is_not_an_object_names_the_file(model_copy):
    (model_copy / "config.json").write_text("[1, 2]")
    assert "must be a JSON object" in config_error(model_copy)


@pytest.mark.parametrize("keep", [0, 7, 100, 5_000_000, -1])
def test_truncated_weights_name_the_file(model_copy, keep):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is not a readable safetensors file"):
        LLM(model_copy, device="cpu")


def test_missing_files_and_folders_are_named(model_copy, tmp_path):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"no \.safetensors weights in {re.escape(str(model_copy))}"):
        LLM(model_copy, device="cpu")
    (model_copy / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"model folder {re.escape(str(model_copy))} has no config.json"):
        LLM(model_copy, device="cpu")
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(ValueError, match=rf"model {re.escape(repr(str(missing)))} is not a bundled model"):
        LLM(missing, device="cpu")
    with pytest.raises(ValueError, match=r"is a file; pass the folder"):
        LLM(model_copy / "tokenizer.json", device="cpu")


def test_sharded_index_problems_name_the_index(model_copy):
    index = model_copy / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(index))} is not a valid safetensors index"):
        checkpoint_files(model_copy)
    index.write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors", "b": "model.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"lists shard\(s\) missing from .*: model-00001.safetensors$"):
        checkpoint_files(model_copy)


# ------------------------------------------------------------------------------------ command line
def cli_error(capsys, *args: str) -> tuple[int, str]:
    """Run the CLI in-process; its stderr must be exactly one ``error:`` line."""
    status = main(list(args))
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return status, err.strip()


def test_cli_reports_bad_input_in_one_line(capsys, model_copy):
    status, err = cli_error(capsys, "generate", "x", "--device", "cuda:99")
    assert status == 2 and err.startswith("error: device 'cuda:99'") and "(available here: cpu" in err
    status, err = cli_error(capsys, "generate", "x", "--max-tokens", "lots")
    assert status == 2 and "argument --max-tokens: invalid int value: 'lots'" in err
    status, err = cli_error(capsys, "generate", "x", "--temperature", "nan")
    assert status == 2 and err.startswith("error: temperature must be a finite number")
    (model_copy / "model.safetensors").write_bytes(b"\x00" * 16)
    status, err = cli_error(capsys, "generate", "x", "--model", str(model_copy), "--device", "cpu")
    assert status == 2 and str(model_copy / "model.safetensors") in err
    (model_copy / "config.json").write_text("{")
    status, err = cli_error(capsys, "generate", "x", "--model", str(model_copy), "--device", "cpu")
    assert status == 2 and err.startswith(f"error: {model_copy / 'config.json'} is not valid JSON")


def test_cli_unexpected_errors_and_ctrl_c_are_one_line(capsys, monkeypatch):
    import minipd

    def broken(*args, **kwargs):
        raise RuntimeError("out of\nmemory")

    monkeypatch.setattr(minipd, "LLM", broken)
    assert cli_error(capsys, "generate", "x") == (1, "error: RuntimeError: out of memory")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(minipd, "LLM", interrupted)
    assert cli_error(capsys, "generate", "x") == (130, "error: interrupted")


def run_cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "minipd", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kwargs)


def test_cli_subprocess_prints_no_traceback_for_a_missing_gpu():
    proc = run_cli("generate", "x", "--device", "cuda:99")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.startswith("error: device 'cuda:99'") and err.count("\n") == 1


def test_cli_ctrl_c_mid_generation_exits_130_in_one_line():
    proc = run_cli("generate", "def", "--max-tokens", "1000", "--device", "cpu")
    try:
        # Wait (bounded) for the first streamed text: generation is under way.
        assert select.select([proc.stdout], [], [], 120)[0] and proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == "error: interrupted\n"


def test_eviction_granularity_is_checked_with_or_without_a_press():
    with refused("kv_eviction_granularity", "kv_eviction_granularity must be 'block' or 'token', got 'pixel'"):
        EngineConfig(kv_eviction_granularity="pixel")
    with refused("kv_eviction_granularity", "kv_eviction_granularity"):
        EngineConfig(kv_eviction="sink-window", kv_budget=64, kv_eviction_granularity="pixel")


def test_abort_takes_one_id_or_a_list_and_refuses_anything_else(llm):
    from minipd.errors import ParameterError

    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    streams = [llm.stream("def f():", params) for _ in range(3)]
    ids = [s.request_id for s in streams]
    assert llm.abort(ids[0]) is True and llm.abort(ids[0]) is False
    assert llm.abort([ids[1], "no-such-id", ids[2]]) == [ids[1], ids[2]]
    assert all([d.finish_reason for d in s][-1] == "abort" for s in streams)
    for bad in ([1, 2], 7, b"id"):
        with pytest.raises(ParameterError, match="request_id") as refused:
            llm.abort(bad)
        assert refused.value.param == "request_id"
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.generate("def f():", SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_engine_options_can_be_given_by_group_and_read_back_by_group():
    from minipd.engine.config import GROUPS

    flat = EngineConfig(block_size=32, kv_cache_dtype="int8", max_num_seqs=4, compile_decode=False)
    grouped = EngineConfig.from_options({"cache": {"block_size": 32, "kv_cache_dtype": "int8"},
                                         "scheduler": {"max_num_seqs": 4}, "compile": {"compile_decode": False}})
    assert grouped == flat and grouped.cache.block_size == 32 and grouped.scheduler.max_num_seqs == 4
    assert sorted(n for names in GROUPS.values() for n in names) == sorted(f for f in flat.__dataclass_fields__)
    assert grouped.grouped()["cache"]["kv_cache_dtype"] == "int8"
    with refused("cache.max_num_seqs", r"cache has no field 'max_num_seqs'"):
        EngineConfig.from_options({"cache": {"max_num_seqs": 4}})
    with refused("block_size", r"block_size is given twice"):
        EngineConfig.from_options({"cache": {"block_size": 32}, "block_size": 16})
    with refused("cache", r"cache must be a dict"):
        EngineConfig.from_options({"cache": 32})
    with refused("block_size", r"^block_size must"):
        EngineConfig.from_options({"cache": {"block_size": True}})
    assert LLM("tiny-py", cache={"num_kv_blocks": 64}).engine.block_manager.num_blocks == 64
