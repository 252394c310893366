"""The disaggregated cluster's routing policy and request phases: pure, no processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from minipd.pd.routing import TRANSITIONS, Phase, Router, blocks_for, check_transition


@dataclass
class Load:
    name: str
    free_blocks: int
    requests: set = field(default_factory=set)

    @property
    def num_requests(self) -> int:
        return len(self.requests)


def test_prefills_go_to_the_least_busy_worker_and_decodes_to_the_most_room():
    router = Router()
    prefill = [Load("p0", 10, {"a", "b"}), Load("p1", 10, {"c"}), Load("p2", 10, {"d", "e"})]
    decode = [Load("d0", 5), Load("d1", 9), Load("d2", 7)]
    assert router.prefill_worker(prefill).name == "p1"
    assert router.decode_worker(decode).name == "d1"


def test_backpressure_counts_the_prefills_on_their_way():
    router = Router()
    decoders = [Load("d0", 10), Load("d1", 6)]
    assert router.decode_has_room(decoders, [], 10)
    assert not router.decode_has_room(decoders, [], 11)
    # A prefill of 5 blocks on its way lands on d0 (the most room): 5 and 6 are left, so 6 fits and 7 does not.
    assert router.decode_has_room(decoders, [5], 6) and not router.decode_has_room(decoders, [5], 7)
    assert router.decode_has_room([], [100], 1_000)  # no decode worker: the prefill workers decode themselves
    assert blocks_for(15, 16) == 1 and blocks_for(16, 16) == 2  # room for the next token too


def test_a_request_only_moves_forward_or_into_recovery():
    for old, allowed in TRANSITIONS.items():
        for new in Phase:
            if new in allowed:
                assert check_transition(old, new) is new
            else:
                with pytest.raises(RuntimeError, match=f"from {old.value} to {new.value}"):
                    check_transition(old, new)
    assert TRANSITIONS[Phase.DECODE] == {Phase.DECODE}  # nothing goes back from decode to prefill
