"""Placing experts on devices from their measured load, with replicas of the hot ones (EPLB's idea).

With expert parallelism each device holds some experts, and the step waits for the device with the
most tokens. Placing experts in order (device 0 gets experts 0..E/D-1) leaves that to chance; with
measured loads one can do better, in two moves:

1. **Replicate**: give ``redundant`` extra copies, one at a time, to the expert with the most load per
   copy (at most one copy per device; a token of a replicated expert goes to any of its copies, and
   we split its load evenly among them);
2. **Pack**: place the copies, heaviest first, each on the least-loaded device with a free slot
   (every device has the same number of slots), avoiding two copies of one expert on one device.

:func:`device_loads` gives each device's tokens for a placement, so the gain reads as the most loaded
device's tokens over the mean, before and after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """Which expert each slot of each device holds: ``slots[d]`` lists device ``d``'s experts."""

    slots: tuple[tuple[int, ...], ...]

    @property
    def replicas(self) -> dict[int, int]:
        """Copies of each expert."""
        counts: dict[int, int] = {}
        for device in self.slots:
            for expert in device:
                counts[expert] = counts.get(expert, 0) + 1
        return counts


def contiguous_placement(num_experts: int, num_devices: int) -> ExpertPlacement:
    """Experts in order, ``num_experts / num_devices`` to a device: what sharding without measurements does."""
    if num_experts % num_devices:
        raise ValueError(f"{num_experts} experts do not split evenly over {num_devices} devices")
    per = num_experts // num_devices
    return ExpertPlacement(tuple(tuple(range(d * per, (d + 1) * per)) for d in range(num_devices)))


def place_experts(loads: Sequence[float], num_devices: int, redundant: int = 0) -> ExpertPlacement:
    """Replicate the hottest experts ``redundant`` times in all and pack the copies on ``num_devices``."""
    num_experts = len(loads)
    slots_total = num_experts + redundant
    if slots_total % num_devices:
        raise ValueError(f"{num_experts} experts + {redundant} replicas do not fill {num_devices} devices evenly")
    copies = [1] * num_experts
    for _ in range(redundant):
        # More copies than devices would put two on one device, which spreads nothing.
        room = [e for e in range(num_experts) if copies[e] < num_devices] or list(range(num_experts))
        hottest = max(room, key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    pieces = sorted(((loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                    key=lambda p: (-p[0], p[1]))
    per_device = slots_total // num_devices
    devices: list[list[int]] = [[] for _ in range(num_devices)]
    totals = [0.0] * num_devices
    for load, expert in pieces:
        open_devices = [d for d in range(num_devices) if len(devices[d]) < per_device]
        # Prefer devices without a copy of this expert (a second copy there would not spread its load).
        fresh = [d for d in open_devices if expert not in devices[d]] or open_devices
        target = min(fresh, key=lambda d: (totals[d], d))
        devices[target].append(expert)
        totals[target] += load
    return ExpertPlacement(tuple(tuple(sorted(d)) for d in devices))


def device_loads(placement: ExpertPlacement, loads: Sequence[float]) -> list[float]:
    """Tokens each device processes: every expert's load split evenly among its copies."""
    copies = placement.replicas
    return [sum(loads[e] / copies[e] for e in device) for device in placement.slots]


def imbalance(placement: ExpertPlacement, loads: Sequence[float]) -> float:
    """The most loaded device's tokens over the mean (1.0 is perfectly even)."""
    per_device = device_loads(placement, loads)
    return max(per_device) / (sum(per_device) / len(per_device))
