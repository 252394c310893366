"""Expert placement from measured load: every expert placed, devices equally full, the most loaded
device never worse than experts in order, and replicas spreading the hottest expert."""

from __future__ import annotations

import random

import pytest

from minipd.moe.placement import contiguous_placement, device_loads, imbalance, place_experts


def test_a_hot_expert_is_replicated_and_its_copies_spread():
    loads = [100, 10, 10, 10, 10, 10, 10, 10]
    plain = contiguous_placement(8, 4)
    assert plain.slots == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert imbalance(plain, loads) == pytest.approx(110 / 42.5)
    placed = place_experts(loads, 4, redundant=4)
    assert placed.replicas[0] == 4 and sum(placed.replicas.values()) == 12
    assert all(len(device) == 3 for device in placed.slots)
    assert all(device.count(0) <= 1 for device in placed.slots)  # copies on different devices
    assert sorted(device_loads(placed, loads)) == pytest.approx([40, 40, 45, 45])
    assert imbalance(placed, loads) < 1.1 < imbalance(place_experts(loads, 4), loads)


@pytest.mark.parametrize("seed", range(20))
def test_random_loads_are_placed_no_worse_than_in_order(seed):
    rng = random.Random(seed)
    experts, devices = 16, 4
    loads = [rng.expovariate(1.0) * 100 for _ in range(experts)]
    for redundant in (0, 4, 8):
        placed = place_experts(loads, devices, redundant)
        assert sorted(placed.replicas) == list(range(experts))
        assert sum(placed.replicas.values()) == experts + redundant
        assert len({len(d) for d in placed.slots}) == 1
        assert sum(device_loads(placed, loads)) == pytest.approx(sum(loads))  # every token goes somewhere
        assert imbalance(placed, loads) <= imbalance(contiguous_placement(experts, devices), loads) + 1e-9


def test_replicas_help_on_average():
    """Greedy packing is a heuristic: one draw may pack a little worse with replicas, but over many draws
    replicas of the hot experts cut the most loaded device's share."""
    rng = random.Random(0)
    draws = [[rng.expovariate(1.0) for _ in range(16)] for _ in range(50)]
    plain = sum(imbalance(place_experts(loads, 4), loads) for loads in draws) / 50
    replicated = sum(imbalance(place_experts(loads, 4, 8), loads) for loads in draws) / 50
    in_order = sum(imbalance(contiguous_placement(16, 4), loads) for loads in draws) / 50
    assert replicated < plain < in_order


def test_uneven_splits_are_refused_by_name():
    with pytest.raises(ValueError, match="do not split evenly over 3 devices"):
        contiguous_placement(8, 3)
    with pytest.raises(ValueError, match="do not fill 4 devices evenly"):
        place_experts([1.0] * 8, 4, redundant=1)
