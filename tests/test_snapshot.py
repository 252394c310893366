"""Resumable snapshots: a run saved mid-way and resumed on a fresh engine gives the uninterrupted run's outputs;
corrupt, partial and mismatched snapshots are refused, leaving the engine as it was."""

from __future__ import annotations

import json
from pathlib import Path

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


def still_generates(engine: Engine, llm: LLM) -> None:
    """A refused load left the engine able to serve: a greedy request gives what a fresh engine gives."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fresh = engine_for(llm)
    want = fresh.make_request([1, 2, 3], params)
    fresh.add(want)
    run_to_end(fresh, [want])
    got = engine.make_request([1, 2, 3], params)
    engine.add(got)
    run_to_end(engine, [got])
    assert got.token_ids == want.token_ids


def refuses(engine: Engine, path, match: str) -> None:
    """Loading ``path`` raises a SnapshotError matching ``match`` and leaves the engine as it was."""
    states, requests, used = dict(engine.processor.states), dict(engine.core.requests), \
        engine.block_manager.num_used_blocks
    with pytest.raises(SnapshotError, match=match):
        engine.load_snapshot(path)
    assert engine.processor.states == states and engine.core.requests == requests  # nothing half-loaded
    assert engine.block_manager.num_used_blocks == used


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
    manifest_path.write_text("[" * 100_000 + "]" * 100_000)  # valid JSON, too deep for the parser
    refuses(engine, snapshot, "not valid JSON")
    manifest = json.loads(manifest_text)
    manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    refuses(engine, snapshot, "version 99")
    rewrite(manifest_path, {**manifest, "version": 1})
    refuses(engine, snapshot, "version 1 manifests had no checksum")
    rewrite(manifest_path, {**manifest, "model": [1, 2]})
    refuses(engine, snapshot, "model is missing or not an object")
    rewrite(manifest_path, {**manifest, "kv_spec": {**manifest["kv_spec"], "latent": True}})
    refuses(engine, snapshot, "another format: latent True")
    rewrite(manifest_path, {**manifest, "requests": [{**manifest["requests"][0], "num_kv_tokens": 10_000}]})
    refuses(engine, snapshot, "num_kv_tokens must be an integer in")

    manifest_path.write_text(manifest_text)
    assert len(engine.load_snapshot(snapshot)) == 4  # the intact snapshot loads on the same engine


# ------------------------------------------------------------------------- saving destroys nothing
def one_request_engine(llm: LLM) -> Engine:
    engine = engine_for(llm)
    engine.add(engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8)))
    engine.step()
    return engine


def test_saving_over_anything_that_is_not_a_snapshot_is_refused_and_leaves_it_alone(llm, tmp_path):
    engine = one_request_engine(llm)
    thesis = tmp_path / "d" / "thesis.tex"
    thesis.parent.mkdir()
    thesis.write_text("\\chapter{One}")
    empty = tmp_path / "empty"
    empty.mkdir()
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(thesis.parent)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for target in (thesis.parent, empty, plain, link, dangling):
        with pytest.raises(SnapshotError, match="is not a minipd snapshot; it was left alone"):
            engine.save_snapshot(target)
    assert thesis.read_text() == "\\chapter{One}" and plain.read_text() == "keep me" and empty.is_dir()
    assert link.is_symlink() and dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "dangling", "empty", "link", "notes.txt"]
    assert sorted(p.name for p in thesis.parent.iterdir()) == ["thesis.tex"]


def test_a_snapshot_folder_with_anything_else_in_it_is_not_replaced(llm, tmp_path):
    engine = one_request_engine(llm)
    taken = engine.save_snapshot(tmp_path / "snap")
    manifest = (taken / "manifest.json").read_text()
    (taken / "README").write_text("mine")  # a file someone added
    with pytest.raises(SnapshotError, match="left alone"):
        engine.save_snapshot(taken)
    assert (taken / "README").read_text() == "mine" and (taken / "manifest.json").read_text() == manifest
    (taken / "README").unlink()
    # A link to a snapshot is not one (replacing it would replace the link, or write through it).
    alias = tmp_path / "alias"
    alias.symlink_to(taken)
    with pytest.raises(SnapshotError, match="left alone"):
        engine.save_snapshot(alias)
    assert alias.is_symlink() and (taken / "manifest.json").read_text() == manifest
    # Where the K/V file should be, a folder of someone's: not a snapshot's file.
    kv = taken / "kv.safetensors"
    kv.unlink()
    kv.mkdir()
    (kv / "data.bin").write_bytes(b"\x01\x02")
    with pytest.raises(SnapshotError, match="left alone"):
        engine.save_snapshot(taken)
    assert (kv / "data.bin").read_bytes() == b"\x01\x02"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias", "snap"]


def test_a_snapshot_is_replaced_whole_and_nothing_is_left_beside_it(llm, tmp_path):
    engine = one_request_engine(llm)
    first = json.loads((engine.save_snapshot(tmp_path / "snap") / "manifest.json").read_text())
    engine.step()
    second = json.loads((engine.save_snapshot(tmp_path / "snap") / "manifest.json").read_text())
    assert second["requests"][0]["all_token_ids"] == first["requests"][0]["all_token_ids"] + [
        second["requests"][0]["all_token_ids"][-1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == ["kv.safetensors", "manifest.json"]


def test_a_failed_save_leaves_the_previous_snapshot_whole(llm, tmp_path, monkeypatch):
    import safetensors.torch

    engine = one_request_engine(llm)
    snap = engine.save_snapshot(tmp_path / "snap")
    before = {p.name: p.read_bytes() for p in snap.iterdir()}
    (tmp_path / "mine.txt").write_text("keep")
    engine.step()

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 10)
        raise OSError("disk full")

    with monkeypatch.context() as patch:  # the K/V file cannot be written
        patch.setattr(safetensors.torch, "save_file", half_written)
        with pytest.raises(OSError, match="disk full"):
            engine.save_snapshot(snap)
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "snap"]  # no staging folder left

    rename = Path.rename

    def no_swap(self, target):
        if Path(target) == snap and self.name.startswith(".snap-"):
            raise OSError("the swap failed")
        return rename(self, target)

    with monkeypatch.context() as patch:  # the new snapshot cannot be renamed into place
        patch.setattr(Path, "rename", no_swap)
        with pytest.raises(OSError, match="the swap failed"):
            engine.save_snapshot(snap)
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == before  # the old one was put back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "snap"]
    assert (tmp_path / "mine.txt").read_text() == "keep"
    assert len(engine_for(llm).load_snapshot(snap)) == 1


def test_no_snapshot_while_outputs_wait_to_be_applied(llm, tmp_path):
    engine = one_request_engine(llm)
    state = next(iter(engine.processor.states.values()))
    add = state.detokenizer.add
    calls = []

    def fails_once(token_id, last=False):
        calls.append(token_id)
        if len(calls) == 1:
            raise RuntimeError("detokenizer hiccup")
        return add(token_id, last)

    state.detokenizer.add = fails_once
    with pytest.raises(RuntimeError, match="hiccup"):
        engine.step()  # the core has the token; the front end will apply it at the next step
    with pytest.raises(SnapshotError, match="wait to be applied"):
        engine.save_snapshot(tmp_path / "snap")
    assert not (tmp_path / "snap").exists()
    engine.step()
    resumed = engine_for(llm)
    resumed.load_snapshot(engine.save_snapshot(tmp_path / "snap"))
    assert resumed.processor.states[state.request_id].token_ids == state.token_ids


# ------------------------------------------------------------------------ loading trusts nothing
def test_an_edited_manifest_is_refused_by_its_checksum(llm, snapshot):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    flipped = [*manifest["requests"][0]["all_token_ids"]]
    flipped[0] = (flipped[0] + 1) % 100  # a flipped prompt token would poison the prefix cache
    manifest["requests"][0]["all_token_ids"] = flipped
    manifest_path.write_text(json.dumps(manifest))
    engine = engine_for(llm)
    refuses(engine, snapshot, "does not match its own checksum")
    still_generates(engine, llm)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r.update(seed="x"), r"requests\[3\] \(request '3'\): seed is not valid"),
    (lambda r: r.update(seed=None), "seed must be the request's integer seed"),
    (lambda r: r.pop("params"), "params is missing"),
    (lambda r: r.pop("request_id"), r"requests\[3\]: request_id is missing"),
    (lambda r: r["params"].pop("top_k"), r"params\.top_k is missing"),
    (lambda r: r.update(params={**r["params"], "temperature": -1}), "params.temperature is not valid"),
    (lambda r: r.update(params={**r["params"], "warp": 9}), r"params\.warp is not a sampling parameter"),
    (lambda r: r.update(params={**r["params"], "stop": 5}), r"params\.stop is not valid"),
    (lambda r: r.update(params=[]), "params must be an object"),
    (lambda r: r.update(all_token_ids=[*r["all_token_ids"][:-1], 10 ** 9]), "all_token_ids must be a list of token"),
    (lambda r: r.update(all_token_ids=[*r["all_token_ids"][:-1], -1]), "all_token_ids must be a list of token"),
    (lambda r: r.update(all_token_ids=[*r["all_token_ids"][:-1], 1.0]), "all_token_ids must be a list of token"),
    (lambda r: r.update(all_token_ids="1 2 3"), "all_token_ids must be a list"),
    (lambda r: r.update(num_prompt_tokens=0), "num_prompt_tokens must be an integer"),
    (lambda r: r.update(num_prompt_tokens="5"), "num_prompt_tokens must be an integer"),
    (lambda r: r.update(hold_kv="no"), "hold_kv must be true or false"),
    (lambda r: r.update(request_id=7), "request_id must be a non-empty string"),
    (lambda r: r.update(prompt=["x"]), "prompt must be a string or null"),
    (lambda r: r.update(index="0"), "index must be an integer"),
    (lambda r: r.update(num_kv_tokens=len(r["all_token_ids"])), "num_kv_tokens must be an integer in"),
    (lambda r: r.update(num_kv_tokens=-1), "num_kv_tokens must be an integer in"),
    (lambda r: r.update(metrics={**r["metrics"], "token_times": "soon"}), "metrics.token_times"),
    (lambda r: r.update(metrics={**r["metrics"], "mood": 1}), "metrics.mood is not a metric"),
    (lambda r: r["metrics"].pop("arrival_time"), "metrics.arrival_time is missing"),
    (lambda r: r.update(metrics=None), "metrics must be an object"),
    (lambda r: r.update(logprobs=[["x"]]), "logprobs must be null: none were asked for"),
    (lambda r: r.update(prompt_logprobs=[None]), "prompt_logprobs must be null: none were asked for"),
    (lambda r: r.update(num_prompt_logprobs_done=2), "num_prompt_logprobs_done must be"),
    (lambda r: r.update(pending_prompt_logprobs=None), "pending_prompt_logprobs must be an empty list"),
    (lambda r: r.update(extra=1), "extra is not a snapshot field"),
])
def test_every_field_is_checked_before_anything_is_admitted(llm, snapshot, edit, message):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    edit(manifest["requests"][-1])  # the last: the three before it would be admitted first if it were not checked
    rewrite(manifest_path, manifest)
    engine = engine_for(llm)
    refuses(engine, snapshot, message)
    still_generates(engine, llm)


@pytest.mark.parametrize(("edit", "message"), [
    # Tokens a request could not have had while still running.
    (lambda r, out: r["params"].update(max_tokens=len(out)), "would have finished"),
    (lambda r, out: r["params"].update(stop_token_ids=[out[1]]), r"output token 1 \(\d+\) is a stop token"),
    (lambda r, out: r["params"].update(stop=["= "]), "hold a stop string"),
    # Log-probabilities that do not go with the tokens and parameters.
    (lambda r, out: r.update(logprobs=[]), "logprobs must be null"),
])
def test_tokens_and_parameters_must_agree(llm, snapshot, edit, message):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    request = manifest["requests"][1]
    outputs = request["all_token_ids"][request["num_prompt_tokens"]:]
    assert llm.tokenizer.decode(outputs) == "level = log"  # (what the fixture's request 1 has output by then)
    edit(request, outputs)
    rewrite(manifest_path, manifest)
    engine = engine_for(llm)
    refuses(engine, snapshot, message)
    still_generates(engine, llm)


def test_a_request_that_cannot_grow_in_this_engine_is_refused_before_any_is_admitted(llm, tmp_path):
    engine = engine_for(llm)
    # 16 prompt tokens and 17 more: 2 blocks of 16 when admitted, 3 once it has output tokens.
    short = engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    long = engine.make_request(list(range(1, 17)), SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))
    engine.add(short)
    engine.add(long)
    for _ in range(3):
        engine.step()
    assert long.token_ids and not long.finished
    snap = engine.save_snapshot(tmp_path / "snap")
    small = engine_for(llm, num_kv_blocks=2)
    refuses(small, snap, r"requests\[1\] \(request '1'\): all_token_ids cannot be resumed in this engine")
    still_generates(small, llm)


def test_duplicate_and_already_running_ids_are_refused_and_nothing_is_half_admitted(llm, snapshot):
    manifest_path = snapshot / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    requests = manifest["requests"]
    rewrite(manifest_path, {**manifest, "requests": [*requests, {**requests[0], "index": 99}]})
    engine = engine_for(llm)
    refuses(engine, snapshot, rf"requests\[4\] \(request {requests[0]['request_id']!r}\): request_id "
                              rf"{requests[0]['request_id']!r} appears more than once \(also requests\[0\]\)")
    still_generates(engine, llm)
    rewrite(manifest_path, {**manifest, "requests": [*requests, {**requests[0], "request_id": "new"}]})
    refuses(engine_for(llm), snapshot, r"requests\[4\] \(request 'new'\): index 0 appears more than once")
    rewrite(manifest_path, manifest)
    engine = engine_for(llm)
    engine.add(engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=30),
                                   request_id=requests[2]["request_id"]))
    refuses(engine, snapshot, rf"requests\[2\] \(request {requests[2]['request_id']!r}\): request_id is already "
                              "running")
    assert list(engine.processor.states) == [requests[2]["request_id"]]  # only the one that was there


def test_logprobs_survive_a_snapshot(llm, tmp_path):
    prompts, _ = workload(llm)
    prompts = [prompts[0], prompts[3], prompts[1]]  # 5, 54 and 40 tokens: the last is mid-prefill after 2 steps
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=20, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1) for i in range(3)]
    whole = engine_for(llm)
    states = [whole.processor.states[whole.add(whole.make_request(p, sp))]
              for p, sp in zip(prompts, params, strict=True)]
    run_to_end(whole, states)
    expected = [s.to_output() for s in states]

    first = engine_for(llm)
    for p, sp in zip(prompts, params, strict=True):
        first.add(first.make_request(p, sp))
    for _ in range(2):
        first.step()
    snap = first.save_snapshot(tmp_path / "snap")
    saved = json.loads((snap / "manifest.json").read_text())["requests"]
    # Tokens (and their logprobs) reported before the snapshot; prompt scores computed but not reported yet.
    assert len(saved[0]["logprobs"]) >= 2 and saved[0]["prompt_logprobs"][0] is None
    assert saved[2]["logprobs"] is None and saved[2]["pending_prompt_logprobs"]
    resumed = engine_for(llm, seed=1)
    ids = resumed.load_snapshot(snap)
    states = [resumed.processor.states[i] for i in ids]
    run_to_end(resumed, states)
    for got, want in zip([s.to_output() for s in states], expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs  # exactly: floats round-trip through JSON
        assert got.prompt_logprobs == want.prompt_logprobs
        assert len(got.logprobs) == 20 and len(got.prompt_logprobs) == len(got.prompt_token_ids)


def other_token(pair: list) -> None:
    """Make a saved ``[token, logprob]`` pair name another token."""
    pair[0] = pair[0] - 1 if pair[0] else 1


@pytest.mark.parametrize(("edit", "message"), [
    (lambda rs: rs[0].update(logprobs=None), "logprobs must be a list of 2 positions"),
    (lambda rs: rs[0].update(logprobs=rs[0]["logprobs"][:1]), "logprobs must be a list of 2 positions"),
    (lambda rs: other_token(rs[0]["logprobs"][1][0]), r"logprobs\[1\] must score token \d+ first"),
    (lambda rs: rs[0]["logprobs"][0].extend([[7, -1.0], [8, -2.0]]), r"logprobs\[0\] must hold 1 to 3"),
    (lambda rs: rs[0]["logprobs"][0][0].__setitem__(1, "-0.5"), r"logprobs\[0\] must hold"),
    (lambda rs: rs[0].update(prompt_logprobs=rs[0]["prompt_logprobs"][1:]), "prompt_logprobs must be a list"),
    (lambda rs: other_token(rs[0]["prompt_logprobs"][2][0]), r"prompt_logprobs\[2\] must score token"),
    (lambda rs: rs[2].update(prompt_logprobs=[None]), "they are reported with the first output token"),
    (lambda rs: rs[2]["pending_prompt_logprobs"].append([[1, -1.0]]), "but num_prompt_logprobs_done says"),
    (lambda rs: rs[0].update(pending_prompt_logprobs=[[[1, -1.0]]]), "must be an empty list once a token"),
])
def test_logprobs_are_checked_against_the_tokens(llm, tmp_path, edit, message):
    prompts, _ = workload(llm)
    engine = engine_for(llm)
    for p in (prompts[0], prompts[3], prompts[1]):
        engine.add(engine.make_request(p, SamplingParams(temperature=0, max_tokens=9, logprobs=2, prompt_logprobs=1)))
    for _ in range(2):
        engine.step()
    snap = engine.save_snapshot(tmp_path / "snap")
    manifest = json.loads((snap / "manifest.json").read_text())
    assert len(manifest["requests"][0]["logprobs"]) == 2 and manifest["requests"][2]["pending_prompt_logprobs"]
    edit(manifest["requests"])
    rewrite(snap / "manifest.json", manifest)
    refuses(engine_for(llm), snap, message)


def test_a_periodic_snapshot_path_that_is_not_a_snapshot_is_refused_when_the_engine_is_built(llm, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("keep")
    with pytest.raises(SnapshotError, match="snapshot_path"):
        engine_for(llm, snapshot_interval=2, snapshot_path=str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "keep"
