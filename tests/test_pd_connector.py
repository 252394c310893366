"""The KV connector's two sides, in one process with a fake transport: no workers, no timing races.

The multi-process behaviour (real transfers, kills, leases) is in test_pd.py; these pin down the
decisions each side makes, including the ones a race would otherwise hide.
"""

from __future__ import annotations

import time

import pytest

from minipd import LLM, SamplingParams
from minipd.pd.connector import GIVEN_UP, KVConnectorScheduler, KVConnectorWorker, Load


class FakeTransport:
    """Records what was started; each handle finishes when the test says so."""

    def __init__(self) -> None:
        self.states: dict[int, str] = {}
        self.writes: list[tuple] = []
        self.reads: list[tuple] = []
        self.sent_notes: list[tuple[str, bytes]] = []
        self.inbox: list[bytes] = []

    def _handle(self) -> int:
        handle = len(self.states)
        self.states[handle] = "PROC"
        return handle

    def start_read(self, peer, remote_blocks, local_blocks, notification):
        self.reads.append((peer, list(remote_blocks), list(local_blocks), notification))
        return self._handle()

    def start_write(self, peer, local_blocks, remote_blocks, layers=None):
        self.writes.append((peer, list(local_blocks), list(remote_blocks), layers))
        return self._handle()

    def poll(self, handle):
        return self.states[handle]

    def notify(self, peer, message):
        self.sent_notes.append((peer, message))

    def notifications(self):
        notes, self.inbox = self.inbox, []
        return notes


@pytest.fixture
def core():
    llm = LLM("tiny-py", num_kv_blocks=32, enable_prefix_caching=False)
    return llm.engine.core


def test_a_released_reservation_waits_for_the_writers_word_when_writes_may_be_under_way(core):
    kv = KVConnectorScheduler(core, lease_s=30)
    free = core.block_manager.num_free_blocks
    assert kv.reserve("a", 40) is not None and kv.reserve("b", 40) is not None and kv.reserve("c", 40) is not None
    assert core.block_manager.num_free_blocks == free - 9
    kv.release_reservation("a", writes_started=False)  # nothing was ever posted: freed at once
    assert core.block_manager.num_free_blocks == free - 6
    kv.release_reservation("b", writes_started=True)  # writes may still land: kept
    assert core.block_manager.num_free_blocks == free - 6 and "b" in kv.releasing
    kv.on_written("b", given_up=False)  # the writer is done: now they can go
    assert core.block_manager.num_free_blocks == free - 3 and not kv.releasing
    kv.on_written("c", given_up=True)  # the writer gave up first: a later release frees at once
    kv.release_reservation("c", writes_started=True)
    assert core.block_manager.num_free_blocks == free


def test_an_adopted_request_is_admitted_only_once_its_reservation_is_filled(core):
    kv = KVConnectorScheduler(core, lease_s=30)
    request = core_request(core, "r", 20)
    assert kv.reserve("r", 20) is not None
    kv.add_adopted(request)
    assert kv.admit_filled() == {} and "r" not in core.requests
    kv.on_written("r", given_up=True)  # given up: never admitted
    assert kv.admit_filled() == {} and "r" not in core.requests
    kv.drop_reservation("r")
    assert kv.reserve("r", 20) is not None
    kv.add_adopted(request)
    kv.on_written("r", given_up=False)
    assert kv.admit_filled() == {} and "r" in core.requests


def test_leases_free_held_blocks_and_unfilled_reservations(core):
    kv = KVConnectorScheduler(core, lease_s=0.05)
    free = core.block_manager.num_free_blocks
    kv.reserve("x", 33)
    kv.reserve("y", 17)
    kv.on_written("y", given_up=False)  # filled: waits for its request, not for the lease
    assert kv.expire() == []
    time.sleep(0.08)
    assert kv.expire() == ["x"]
    assert core.block_manager.num_free_blocks == free - 2 and "y" in kv.reserved_at


def test_worker_side_reports_saves_only_after_every_write_and_tells_the_reader(core):
    transport = FakeTransport()
    mover = KVConnectorWorker(transport, block_size=16, bytes_per_block=1200, num_layers=6, lease_s=30)
    mover.add_save("p", "decode0", [7, 8], layerwise=False)
    assert mover.get_finished().done_sending == {}  # not prefilled: nothing posted yet
    mover.prefill_done("p", [3, 4])
    assert transport.writes == [("decode0", [3, 4], [7, 8], None)]
    assert mover.get_finished().done_sending == {}
    transport.states[0] = "DONE"
    finished = mover.get_finished()
    assert list(finished.done_sending) == ["p"] and finished.done_sending["p"].num_bytes == 2400
    assert transport.sent_notes == [("decode0", b"p")]


def test_worker_side_gives_up_loudly_on_a_failed_write_and_quietly_on_an_abort(core):
    transport = FakeTransport()
    mover = KVConnectorWorker(transport, block_size=16, bytes_per_block=1200, num_layers=6, lease_s=30)
    mover.add_save("bad", "decode0", [1], layerwise=False)
    mover.add_save("gone", "decode0", [2], layerwise=False)
    mover.prefill_done("bad", [5])
    mover.prefill_done("gone", [6])
    transport.states[0] = "ERR"
    mover.abort_save("gone")
    finished = mover.get_finished()
    assert finished.failed_sending == {"bad": "push failed"}
    assert finished.dropped_sending == []  # its write is still under way
    transport.states[1] = "DONE"
    assert mover.get_finished().dropped_sending == ["gone"]
    assert transport.sent_notes == [("decode0", GIVEN_UP + b"bad"), ("decode0", GIVEN_UP + b"gone")]


def test_worker_side_loads_finish_fail_or_run_into_their_lease(core):
    transport = FakeTransport()
    mover = KVConnectorWorker(transport, block_size=16, bytes_per_block=1200, num_layers=6, lease_s=0.05)
    mover.start_load_kv("ok", Load("prefill0", [9, 10, 11]), [1, 2])
    mover.start_load_kv("err", Load("prefill0", [12]), [3])
    mover.start_load_kv("slow", Load("prefill0", [13]), [4])
    assert transport.reads[0] == ("prefill0", [9, 10], [1, 2], b"ok")  # only as many blocks as allocated
    transport.states[0], transport.states[1] = "DONE", "ERR"
    transport.inbox = [b"q", GIVEN_UP + b"w"]
    finished = mover.get_finished()
    assert finished.done_recving["ok"][0] == 2400 and list(finished.failed_recving) == ["err"]
    assert finished.notes == [("q", False), ("w", True)]
    time.sleep(0.08)
    assert list(mover.get_finished().failed_recving) == ["slow"] and not mover.loads


def core_request(core, request_id: str, prompt_len: int):
    from minipd.engine.request import Request

    return Request(request_id=request_id, all_token_ids=list(range(1, prompt_len + 2)),
                   num_prompt_tokens=prompt_len + 1, params=SamplingParams(max_tokens=4), seed=0,
                   eos_token_ids=frozenset(), max_model_len=core.max_model_len, arrival_time=time.perf_counter(),
                   num_external_tokens=prompt_len)
