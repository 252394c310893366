"""Expert parallelism: the all-to-all dispatcher against the local one, then whole models over processes.

The first tests run every rank as a thread of this process (each with its own gloo group), so they
are quick and can compare against a full copy of the layer. The rest spawn real ranks through
``LLM(..., expert_parallel_size=2)``: greedy outputs equal to one process, faults (a rank killed, a
rank stalled past the timeout, the parent killed) turned into clear errors, and every process gone
at the end, even when a test fails.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import assert_child_exits_with_its_parent

from minipd import LLM, SamplingParams
from minipd.engine.expert_ranks import moe_layers_of
from minipd.layers.moe import MoE
from minipd.moe.dispatch import LocalDispatcher
from minipd.moe.expert_parallel import (
    ExpertParallelDispatcher,
    ExpertParallelError,
    ExpertParallelGroup,
    decode_rows,
    encode_rows,
    loopback_store,
    shard_experts,
)

HIDDEN, WIDTH, EXPERTS, TOP_K = 32, 16, 8, 2


def _groups(world: int, **options) -> list[ExpertParallelGroup]:
    """``world`` groups joined through one store, one per rank, all in this process."""
    store = loopback_store(world, 60)
    groups: list[ExpertParallelGroup | None] = [None] * world

    def join(rank: int) -> None:
        own = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world, False)
        groups[rank] = ExpertParallelGroup.connect(rank, world, EXPERTS, own, timeout=20, **options)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in groups), "a rank did not join"
    return groups  # type: ignore[return-value]


def _layer(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(HIDDEN, WIDTH, EXPERTS, TOP_K, implementation="loop").eval()


def _run_ranks(groups, layer: MoE, inputs: list[torch.Tensor | None], row_format: str | None = None):
    """Each rank runs the layer's expert stage on its tokens (None: it only serves). Returns each rank's output."""
    outputs: list = [None] * len(groups)
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            experts = copy.deepcopy(layer.experts)
            shard_experts(experts, groups[rank])
            dispatcher = ExpertParallelDispatcher(groups[rank], 0, EXPERTS)
            tokens = inputs[rank]
            if tokens is None:
                received = groups[rank].exchange_headers(groups[rank].idle_headers(), idle=True)
                dispatcher.serve(received, experts, torch.float32, HIDDEN)
            else:
                weights, ids = layer.router(tokens)
                outputs[rank] = dispatcher.run(tokens, weights, ids, experts, row_format)
        except Exception as err:  # surfaced by the test
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return outputs


def _local(layer: MoE, tokens: torch.Tensor, row_format: str | None = None) -> torch.Tensor:
    weights, ids = layer.router(tokens)
    return LocalDispatcher(EXPERTS).run(tokens, weights, ids, layer.experts, row_format)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("micro_batches,overlap", [(1, False), (2, False), (2, True)])
def test_one_rank_with_tokens_gets_the_local_layers_answer(world, micro_batches, overlap):
    layer = _layer()
    groups = _groups(world, micro_batches=micro_batches)
    for g in groups:
        g.overlap = overlap
    groups[0].trace = []
    tokens = torch.randn(7, HIDDEN)
    out = _run_ranks(groups, layer, [tokens] + [None] * (world - 1))[0]
    torch.testing.assert_close(out, _local(layer, tokens))
    stats = groups[0].stats
    assert sum(stats.dispatch_sent_to.values()) == stats.dispatch_sent
    assert sum(stats.combine_received_from.values()) == stats.combine_received
    (events,) = groups[0].trace
    assert sorted(e[0] for e in events) == sorted(f"{what} {m}" for what in ("dispatch", "experts", "combine")
                                                  for m in range(micro_batches))
    assert all(start <= end for _, start, end in events)
    # Every (token, expert) pair for another rank's experts left as one fp32 row, and came back as one.
    _, ids = layer.router(tokens)
    remote = int((ids >= EXPERTS // world).sum())
    assert stats.rows_sent == remote
    assert stats.dispatch_sent == stats.combine_received == remote * HIDDEN * 4
    assert stats.calls == 1


def test_every_rank_with_tokens_symmetric_all_to_all():
    layer = _layer(1)
    groups = _groups(2)
    inputs = [torch.randn(5, HIDDEN), torch.randn(9, HIDDEN)]
    outs = _run_ranks(groups, layer, inputs)
    for tokens, out in zip(inputs, outs, strict=True):
        torch.testing.assert_close(out, _local(layer, tokens))
    # What rank 0 sent rank 1 is what rank 1 received, both ways.
    assert groups[0].stats.dispatch_sent == groups[1].stats.dispatch_received > 0
    assert groups[1].stats.combine_sent == groups[0].stats.combine_received > 0


@pytest.mark.parametrize("row_format", ["int8", "fp8"])
def test_compressed_dispatch_moves_codes_and_matches_the_fake_quantized_local_layer(row_format):
    layer = _layer(2)
    groups = _groups(2)
    tokens = torch.randn(6, HIDDEN)
    out = _run_ranks(groups, layer, [tokens, None], row_format)[0]
    torch.testing.assert_close(out, _local(layer, tokens, row_format))
    assert not torch.allclose(out, _local(layer, tokens), atol=1e-6)  # the rounding is really there
    # int8/fp8 codes plus a 2-byte scale per row instead of 4-byte floats.
    assert groups[0].stats.dispatch_sent == groups[0].stats.rows_sent * (HIDDEN + 2)


def test_row_codec_round_trip():
    rows = torch.randn(4, HIDDEN)
    assert torch.equal(decode_rows(encode_rows(rows, None), None, torch.float32), rows)
    packed = encode_rows(rows, "int8")
    assert packed.dtype == torch.uint8 and packed.shape == (4, HIDDEN + 2)
    assert (decode_rows(packed, "int8", torch.float32) - rows).abs().max() <= rows.abs().max() / 127


def test_ranks_running_different_layers_is_an_error_not_a_wrong_answer():
    layer = _layer()
    groups = _groups(2, micro_batches=1)
    for g in groups:
        g.timeout = __import__("datetime").timedelta(seconds=3)
    tokens = torch.randn(3, HIDDEN)
    errors: list = []

    def serve_wrong_layer() -> None:
        experts = copy.deepcopy(layer.experts)
        shard_experts(experts, groups[1])
        received = groups[1].exchange_headers(groups[1].idle_headers(), idle=True)
        try:
            ExpertParallelDispatcher(groups[1], 5, EXPERTS).serve(received, experts, torch.float32, HIDDEN)
        except ExpertParallelError as err:
            errors.append(err)

    server = threading.Thread(target=serve_wrong_layer)
    server.start()
    experts = copy.deepcopy(layer.experts)
    shard_experts(experts, groups[0])
    weights, ids = layer.router(tokens)
    with pytest.raises(ExpertParallelError):
        ExpertParallelDispatcher(groups[0], 0, EXPERTS).run(tokens, weights, ids, experts)
    server.join(timeout=30)
    assert errors and "disagree" in str(errors[0])


# ------------------------------------------------------------------------------ whole models, processes

PROMPTS = ["def fib(n):", "import os\nclass Foo:", "for i in range(10):\n    print(", "x = [", "return"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("tiny-py-moe", moe_backend="loop")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _stop(llm: LLM) -> list:
    """Close ``llm`` and return its rank processes (for the caller to check they are gone)."""
    processes = list(llm.expert_parallel.processes) if llm.expert_parallel else []
    llm.close()
    return processes


@pytest.mark.parametrize("options", [dict(), dict(expert_parallel_overlap=False, moe_dispatch_dtype="auto"),
                                     dict(moe_backend="grouped_mm", max_num_batched_tokens=8)])
def test_greedy_outputs_equal_one_process_and_ranks_are_cleaned_up(reference, options):
    options = {"moe_backend": "loop", **options}
    llm = LLM("tiny-py-moe", expert_parallel_size=2, **options)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        stats = llm.expert_parallel.stats
        assert stats.calls > 0 and stats.dispatch_sent > 0 and stats.combine_received == stats.dispatch_sent
    finally:
        processes = _stop(llm)
    assert processes and not any(p.is_alive() for p in processes)
    llm.close()  # idempotent


def test_four_ranks_and_compressed_dispatch():
    one = LLM("tiny-py-moe", moe_backend="loop", moe_dispatch_dtype="int8")
    expected = [o.token_ids for o in one.generate(PROMPTS[:2], GREEDY)]
    with LLM("tiny-py-moe", moe_backend="loop", moe_dispatch_dtype="int8", expert_parallel_size=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == expected
        stats = llm.expert_parallel.stats
        assert stats.dispatch_sent == stats.rows_sent * (one.config.hidden_size + 2)
        processes = llm.expert_parallel.processes
        _assert_loopback_only([os.getpid()] + [p.pid for p in processes])
    assert len(processes) == 3 and not any(p.is_alive() for p in processes)


def test_a_killed_rank_is_an_error_and_the_rest_shuts_down():
    llm = LLM("tiny-py-moe", moe_backend="loop", expert_parallel_size=2, expert_parallel_timeout=20)
    try:
        rank1 = llm.expert_parallel.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(ExpertParallelError):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 20  # the closed connection is seen at once, not after the timeout
        with pytest.raises(ExpertParallelError, match="unusable"):  # and stays an error, fast
            llm.generate(PROMPTS[:1], GREEDY)
        assert not llm.engine.has_unfinished_requests()  # nothing admitted is left half-done
    finally:
        processes = _stop(llm)
    assert not any(p.is_alive() for p in processes)


def test_a_stalled_rank_hits_the_timeout():
    llm = LLM("tiny-py-moe", moe_backend="loop", expert_parallel_size=2, expert_parallel_timeout=2)
    rank1 = llm.expert_parallel.processes[0]
    try:
        os.kill(rank1.pid, signal.SIGSTOP)  # alive, connected, silent
        start = time.monotonic()
        with pytest.raises(ExpertParallelError):
            llm.generate(PROMPTS[:1], GREEDY)
        assert 1.5 < time.monotonic() - start < 30
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
        processes = _stop(llm)
    assert not any(p.is_alive() for p in processes)


def test_the_ranks_exit_when_their_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from minipd import LLM\n"
        "if __name__ == '__main__':  # ranks are spawned: they import this file again\n"
        "    llm = LLM('tiny-py-moe', moe_backend='loop', expert_parallel_size=2)\n"
        "    print(llm.expert_parallel.processes[0].pid, flush=True)\n"
        "    time.sleep(600)\n")
    assert_child_exits_with_its_parent(script, "an expert-parallel rank")


@pytest.mark.parametrize("options,message", [
    (dict(model="tiny-py"), "needs a mixture-of-experts model"),
    (dict(expert_parallel_size=3), "must divide the number of experts"),
    (dict(expert_parallel_size=0), "expert_parallel_size must be a positive integer"),
    (dict(moe_capacity_factor=1.5), "moe_capacity_factor needs all experts in one process"),
    (dict(moe_backend="triton"), "moe_backend='triton'"),
    (dict(expert_parallel_timeout=0), "expert_parallel_timeout must be"),
])
def test_bad_expert_parallel_options_are_clear_errors(options, message):
    options = {"model": "tiny-py-moe", "expert_parallel_size": 2, **options}
    with pytest.raises(ValueError, match=message):
        LLM(options.pop("model"), **options)


def test_sharding_keeps_this_ranks_slice():
    layer = _layer()
    group = ExpertParallelGroup(1, 4, EXPERTS, process_group=None)
    experts = copy.deepcopy(layer.experts)
    shard_experts(experts, group)
    assert experts.num_experts == 2
    assert torch.equal(experts.down_proj, layer.experts.down_proj[2:4])
    assert moe_layers_of(torch.nn.Sequential(layer)) == [layer]


def test_moe_prefill_and_decode_workers_each_with_their_own_expert_ranks(reference):
    from minipd.pd.llm import DisaggregatedLLM

    with DisaggregatedLLM("tiny-py-moe", moe_backend="loop", expert_parallel_size=2, start_timeout=120) as pd:
        got = [o.token_ids for o in pd.generate(PROMPTS[:2], GREEDY)]
    assert got == reference[:2]
    deadline = time.monotonic() + 20  # the workers' ranks see their rank 0 go and exit
    while (leftovers := subprocess.run(["pgrep", "-f", "minipd.engine.expert_ranks"], capture_output=True,
                                       text=True).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers, f"expert-parallel ranks left running: {leftovers}"


def _assert_loopback_only(pids: list[int]) -> None:
    """Every TCP socket these processes listen on is bound to 127.0.0.1 (the store and gloo's pairs)."""
    import shutil

    if shutil.which("ss") is None:
        pytest.fail("`ss` (iproute2) is needed to check the listening sockets")
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    ours = [line for line in lines if any(f"pid={pid}," in line for pid in pids)]
    assert ours, "no listening socket found for the ranks"
    assert all(line.split()[3].startswith("127.0.0.1:") for line in ours), ours
