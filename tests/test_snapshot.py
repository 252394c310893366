"""Resumable snapshots: a run saved mid-way and resumed on a fresh engine gives the uninterrupted run's outputs;
corrupt, partial and mismatched snapshots are refused, leaving the engine as it was."""

from __future__ import annotations

import json

import pytest

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.engine.snapshot import SnapshotError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py")


def engine_for(llm: LLM, seed: int = 0, **options) -> Engine:
    config = EngineConfig(**{"num_kv_blocks": 128, "max_num_batched_tokens": 48, **options})
    return Engine(llm.model, llm.tokenizer, config, llm.max_model_len, llm.engine.eos_token_ids, seed=seed)


def workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    text = "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser()\n" * 4
    ids = llm.tokenizer.encode(text)
    prompts = [ids[i:i + n] for i, n in zip(range(0, 60, 6), [5, 40, 12, 70, 25, 9, 55, 30, 18, 64], strict=True)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i, max_tokens=24, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7, seed=70 + i, max_tokens=24, stop=["\n\n"]))
    # No seed: the engine draws one; a resumed request must keep the one it was given.
    params[4] = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    return prompts, params


def run_to_end(engine: Engine, states) -> None:
    for _ in range(1000):
        if all(s.finished for s in states):
            return
        engine.step()
    raise AssertionError("not finished after 1000 steps")


def test_a_snapshot_taken_mid_run_resumes_to_the_same_outputs(llm, tmp_path):
    prompts, params = workload(llm)
    whole = engine_for(llm)
    states = [whole.make_request(p, sp, request_id=f"q{i}") for i, (p, sp) in enumerate(zip(prompts, params,
                                                                                          strict=True))]
    for state in states:
        whole.add(state)
    run_to_end(whole, states)
    expected = {s.request_id: (s.token_ids, s.text, s.finish_reason) for s in states}

    first = engine_for(llm)
    halves = [first.make_request(p, sp, request_id=f"q{i}") for i, (p, sp) in enumerate(zip(prompts, params,
                                                                                          strict=True))]
    for state in halves:
        first.add(state)
    for _ in range(3):  # some requests decode, some are mid-prefill (a 48-token budget), some still wait
        first.step()
    kinds = {s.request.status.value for s in halves if not s.finished}
    assert {"running", "waiting"} <= kinds
    assert any(0 < s.request.num_computed_tokens < s.request.num_prompt_tokens for s in halves)
    path = first.save_snapshot(tmp_path / "snap")
    unfinished = {s.request_id for s in halves if not s.finished}
    done_before = {s.request_id: (s.token_ids, s.text, s.finish_reason) for s in halves if s.finished}

    resumed = engine_for(llm, seed=123)  # would draw other seeds: the saved ones must be used
    ids = resumed.load_snapshot(path)
    assert set(ids) == unfinished
    restored = {rid: resumed.processor.states[rid] for rid in ids}
    # Requests that had K/V bring them: nothing they had computed is computed again.
    assert all(r.request.num_external_tokens == halves[int(rid[1:])].request.num_computed_tokens
               for rid, r in restored.items())
    run_to_end(resumed, list(restored.values()))
    got = {rid: (s.token_ids, s.text, s.finish_reason) for rid, s in restored.items()} | done_before
    assert got == expected
    assert resumed.block_manager.num_used_blocks == 0


def test_periodic_snapshots_replace_the_folder_whole(llm, tmp_path):
    prompts, params = workload(llm)
    engine = engine_for(llm, snapshot_interval=2, snapshot_path=str(tmp_path / "periodic"))
    for p, sp in zip(prompts[:3], params[:3], strict=True):
        engine.add(engine.make_request(p, sp))
    for _ in range(4):
        engine.step()
    manifest = json.loads((tmp_path / "periodic" / "manifest.json").read_text())
    assert len(manifest["requests"]) == sum(1 for s in engine.processor.states.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["periodic"]  # no staging folders left behind


@pytest.fixture()
def snapshot(llm, tmp_path):
    prompts, params = workload(llm)
    engine = engine_for(llm)
    for p, sp in zip(prompts[:4], params[:4], strict=True):
        engine.add(engine.make_request(p, sp))
    for _ in range(3):
        engine.step()
    return engine.save_snapshot(tmp_path / "snap")


def refuses(engine: Engine, path, match: str) -> None:
    with pytest.raises(SnapshotError, match=match):
        engine.load_snapshot(path)
    assert not engine.processor.states and not engine.core.requests  # nothing half-loaded
    assert engine.block_manager.num_used_blocks == 0


def test_corrupt_partial_and_mismatched_snapshots_are_refused(llm, snapshot):
    manifest_path, kv_path = snapshot / "manifest.json", snapshot / "kv.safetensors"
    manifest_text, kv_bytes = manifest_path.read_text(), kv_path.read_bytes()
    engine = engine_for(llm)

    refuses(engine_for(llm, block_size=8), snapshot, "another format: block_size 16")
    refuses(Engine(llm.model, llm.tokenizer, EngineConfig(num_kv_blocks=64), 128, llm.engine.eos_token_ids),
            snapshot, "another model: max_model_len")

    kv_path.write_bytes(kv_bytes[:len(kv_bytes) // 2])  # a partly written file
    refuses(engine, snapshot, "checksum")
    kv_path.unlink()
    refuses(engine, snapshot, "partial")
    kv_path.write_bytes(kv_bytes)

    manifest_path.write_text(manifest_text[:-40])
    refuses(engine, snapshot, "not valid JSON")
    manifest = json.loads(manifest_text)
    manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    refuses(engine, snapshot, "version 99")
    manifest_path.write_text(json.dumps({**manifest, "requests": [{**manifest["requests"][0], "num_kv_tokens": 10_000}]
                                         }))
    refuses(engine, snapshot, "K/V of request")

    manifest_path.write_text(manifest_text)
    assert len(engine.load_snapshot(snapshot)) == 4  # the intact snapshot loads on the same engine
