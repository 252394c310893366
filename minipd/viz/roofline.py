"""The roofline: attainable FLOP/s against arithmetic intensity, log-log, for one or more devices.

A device is two numbers (:class:`~minipd.sim.costs.DeviceSpec`): peak FLOP/s, the flat roof, and
memory bandwidth, the slanted one (``intensity × bandwidth``). A step with intensity ``I`` FLOP/byte
cannot run faster than ``min(peak, I × bandwidth)``; left of the ridge point it is memory-bound,
right of it compute-bound. matplotlib is imported inside the function: ``import minipd`` never pays
for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minipd.sim.costs import DeviceSpec

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class RooflinePoint:
    """A step to place on the plot.

    With ``flops_per_s`` None the point is analytic: it is drawn on the roof of each device in
    ``devices`` (all the plotted devices when empty), i.e. at the best that device could do.
    With ``flops_per_s`` set it is a measurement, drawn once at that height.
    """

    label: str
    intensity: float
    flops_per_s: float | None = None
    devices: tuple[str, ...] = ()
    color: str | None = None
    marker: str = "o"


def plot_roofline(devices: Sequence[DeviceSpec], points: Sequence[RooflinePoint] = (), ax: Axes | None = None,
                  intensity_range: tuple[float, float] | None = None) -> Axes:
    """Draw each device's roofline and the given points; FLOP/s on a log y axis, FLOP/byte on a log x axis.

    Each roof is one line labelled with the device name and its ridge point, with gid
    ``"roof:<name>"``; each point's marker has gid ``"point:<label>"`` (one marker per device for an
    analytic point), so tests and readers can find the plotted data.

    Args:
        devices: what to draw roofs for.
        points: steps to place; see :class:`RooflinePoint`.
        ax: Axes to draw on; a new figure is made when None.
        intensity_range: x limits in FLOP/byte; by default from 0.1 to 10x the largest ridge point
            or point intensity.

    Returns:
        The Axes drawn on.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if not devices:
        raise ValueError("plot_roofline needs at least one DeviceSpec")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    by_name = {d.name: d for d in devices}
    if intensity_range is None:
        largest = max([d.ridge_point for d in devices] + [p.intensity for p in points])
        smallest = min([0.1] + [p.intensity / 3 for p in points if p.intensity > 0])
        intensity_range = (smallest, largest * 10)
    x = np.geomspace(*intensity_range, 256)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, device in enumerate(devices):
        y = np.minimum(device.peak_flops, x * device.mem_bandwidth)
        ax.plot(x, y, color=colors[i % len(colors)], lw=2, gid=f"roof:{device.name}",
                label=f"{device.name}: ridge at {device.ridge_point:.3g} FLOP/B")
        ax.axvline(device.ridge_point, color=colors[i % len(colors)], lw=0.8, ls=":", alpha=0.7)
    for j, point in enumerate(points):
        color = point.color or colors[(len(devices) + j) % len(colors)]
        if point.flops_per_s is not None:
            xs, ys = [point.intensity], [point.flops_per_s]
        else:
            unknown = [n for n in point.devices if n not in by_name]
            if unknown:
                raise ValueError(f"point {point.label!r} names devices not plotted: {', '.join(unknown)}")
            names = point.devices or tuple(by_name)
            xs = [point.intensity] * len(names)
            ys = [by_name[n].attainable_flops(point.intensity) for n in names]
        ax.scatter(xs, ys, s=60, color=color, marker=point.marker, zorder=3, edgecolor="black", linewidth=0.6,
                   gid=f"point:{point.label}", label=point.label)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="attainable FLOP/s", title="roofline", xlim=intensity_range)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return ax
