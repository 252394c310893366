"""Resumable snapshots: a run saved mid-way and resumed on a fresh engine gives the uninterrupted run's outputs;
corrupt, partial and mismatched snapshots are refused, leaving the engine as it was."""

from __future__ import annotations

import json

import pytest

from minipd import LLM, SamplingParams
from minipd.engine.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.engine.snapshot import SnapshotError, manifest_checksum


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


def rewrite(manifest_path, manifest: dict) -> None:
    """Write an edited manifest with a valid checksum, so the checks after the checksum are what refuse it."""
    manifest = {**manifest, "manifest_sha256": manifest_checksum(manifest)}
    manifest_path.write_text(json.dumps(manifest))


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
    rewrite(manifest_path, {**manifest, "requests": [{**manifest["requests"][0], "num_kv_tokens": 10_000}]})
    refuses(engine, snapshot, "num_kv_tokens must be an integer in")

    manifest_path.write_text(manifest_text)
    assert len(engine.load_snapshot(snapshot)) == 4  # the intact snapshot loads on the same engine


# ------------------------------------------------------------------------- saving destroys nothing
def test_saving_over_anything_that_is_not_a_snapshot_is_refused_and_leaves_it_alone(llm, tmp_path):
    engine = engine_for(llm)
    engine.add(engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8)))
    engine.step()
    thesis = tmp_path / "d" / "thesis.tex"
    thesis.parent.mkdir()
    thesis.write_text("\\chapter{One}")
    empty = tmp_path / "empty"
    empty.mkdir()
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(thesis.parent)
    for target in (thesis.parent, empty, plain, link):
        with pytest.raises(SnapshotError, match="is not a minipd snapshot; it was left alone"):
            engine.save_snapshot(target)
    assert thesis.read_text() == "\\chapter{One}" and plain.read_text() == "keep me" and empty.is_dir()
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["d", "empty", "link", "notes.txt"]
    # A snapshot folder someone added a file to is not ours alone any more: refused too.
    taken = engine.save_snapshot(tmp_path / "snap")
    (taken / "README").write_text("mine")
    with pytest.raises(SnapshotError, match="left alone"):
        engine.save_snapshot(taken)
    assert (taken / "README").read_text() == "mine"


def test_a_snapshot_is_replaced_whole_and_nothing_is_left_beside_it(llm, tmp_path):
    engine = engine_for(llm)
    engine.add(engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8)))
    engine.step()
    first = json.loads((engine.save_snapshot(tmp_path / "snap") / "manifest.json").read_text())
    engine.step()
    second = json.loads((engine.save_snapshot(tmp_path / "snap") / "manifest.json").read_text())
    assert second["requests"][0]["all_token_ids"] == first["requests"][0]["all_token_ids"] + [
        second["requests"][0]["all_token_ids"][-1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == ["kv.safetensors", "manifest.json"]


# ------------------------------------------------------------------------ loading trusts nothing
def test_an_edited_manifest_is_refused_by_its_checksum(llm, snapshot):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    flipped = [*manifest["requests"][0]["all_token_ids"]]
    flipped[0] = (flipped[0] + 1) % 100  # a flipped prompt token would poison the prefix cache
    manifest["requests"][0]["all_token_ids"] = flipped
    manifest_path.write_text(json.dumps(manifest))
    refuses(engine_for(llm), snapshot, "does not match its own checksum")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r.update(seed="x"), r"requests\[3\] \(request '3'\): seed is not valid"),
    (lambda r: r.update(seed=None), "seed must be the request's integer seed"),
    (lambda r: r.pop("params"), "params is missing"),
    (lambda r: r.update(params={**r["params"], "temperature": -1}), "params.temperature is not valid"),
    (lambda r: r.update(params={**r["params"], "warp": 9}), "params is not a set of sampling parameters"),
    (lambda r: r.update(all_token_ids=[*r["all_token_ids"][:-1], 10 ** 9]), "all_token_ids must be a list of token"),
    (lambda r: r.update(all_token_ids="1 2 3"), "all_token_ids must be a list"),
    (lambda r: r.update(num_prompt_tokens=0), "num_prompt_tokens must be an integer"),
    (lambda r: r.update(hold_kv="no"), "hold_kv must be true or false"),
    (lambda r: r.update(request_id=7), "request_id must be a non-empty string"),
    (lambda r: r.update(metrics={**r["metrics"], "token_times": "soon"}), "metrics.token_times"),
    (lambda r: r.update(metrics={**r["metrics"], "mood": 1}), "metrics.mood is not a metric"),
    (lambda r: r.update(logprobs=[["x"]]), "logprobs must"),
    (lambda r: r.update(extra=1), "extra is not a snapshot field"),
])
def test_every_field_is_checked_before_anything_is_admitted(llm, snapshot, edit, message):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    edit(manifest["requests"][-1])
    rewrite(manifest_path, manifest)
    engine = engine_for(llm)
    refuses(engine, snapshot, message)
    engine.add(engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3)))
    run_to_end(engine, list(engine.processor.states.values()))  # the engine still works


def test_duplicate_and_already_running_ids_are_refused_and_nothing_is_half_admitted(llm, snapshot):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    requests = manifest["requests"]
    rewrite(manifest_path, {**manifest, "requests": [*requests, {**requests[0], "index": 99}]})
    refuses(engine_for(llm), snapshot, f"request id {requests[0]['request_id']!r} appears more than once")
    rewrite(manifest_path, manifest)
    engine = engine_for(llm)
    engine.add(engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=30),
                                   request_id=requests[2]["request_id"]))
    with pytest.raises(SnapshotError, match="already running"):
        engine.load_snapshot(snapshot)
    assert list(engine.processor.states) == [requests[2]["request_id"]]  # only the one that was there


def test_logprobs_survive_a_snapshot(llm, tmp_path):
    prompts, _ = workload(llm)
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=20, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1) for i in range(3)]
    whole = engine_for(llm)
    states = [whole.processor.states[whole.add(whole.make_request(p, sp))]
              for p, sp in zip(prompts, params, strict=False)]
    run_to_end(whole, states)
    expected = [s.to_output() for s in states]

    first = engine_for(llm)
    for p, sp in zip(prompts, params, strict=False):
        first.add(first.make_request(p, sp))
    for _ in range(6):  # some mid-prefill (chunked), some decoding
        first.step()
    resumed = engine_for(llm, seed=1)
    ids = resumed.load_snapshot(first.save_snapshot(tmp_path / "snap"))
    states = [resumed.processor.states[i] for i in ids]
    run_to_end(resumed, states)
    for got, want in zip([s.to_output() for s in states], expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs
        assert got.prompt_logprobs == want.prompt_logprobs
