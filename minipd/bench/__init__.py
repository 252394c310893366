"""Benchmarks: ``python -m minipd bench [--workload ...]``, each printing ratios measured in the same run.

- :mod:`minipd.bench.hf`: minipd against HF transformers on the same model and requests (the default);
- :mod:`minipd.bench.pd`: prefill/decode interference, colocated against split (``--workload pd``);
- :mod:`minipd.bench.adaptive`: adaptive KV precision under load (``--workload adaptive``);
- :mod:`minipd.bench.moe`: the MoE kernel ladder (``--workload moe``);
- :mod:`minipd.bench.expert_parallel`: expert parallelism, overlap and wire bytes (``--workload ep``);
- :mod:`minipd.bench.floor`: the speed-of-light floor of a step (one pass over the weights, the FLOPs);
- :mod:`minipd.bench.random_models`: random-weight models of a chosen size to time (``--model random-50m``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minipd._lazy import lazy_exports

if TYPE_CHECKING:  # (for type checkers and editors; at run time each name is imported on first use)
    from minipd.bench.hf import Workload, file_workload, machine_label, main, make_workload, random_workload

_WHERE = {
    "Workload": "minipd.bench.hf",
    "main": "minipd.bench.hf",
    "make_workload": "minipd.bench.hf",
    "random_workload": "minipd.bench.hf",
    "file_workload": "minipd.bench.hf",
    "machine_label": "minipd.bench.hf",
}

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

__all__ = ["Workload", "file_workload", "machine_label", "main", "make_workload", "random_workload"]
