"""How many CPU threads a step gets (``cpu_threads=``).

A step of a few tokens (one or two streams decoding) is a string of small matrix products: splitting
each over two threads costs a fork/join per product and buys little, and when the machine is busy
a second thread mostly waits for a core. Big steps (prefill chunks, large decode batches) do gain
from every core. ``"auto"`` therefore runs steps of up to :data:`SMALL_STEP_TOKENS` tokens on one thread
and bigger ones on the threads torch had when the engine was built; a number fixes the count. Where
the crossing lies depends on the machine: ``python -m minipd build-kernels`` measures it, and the
engine uses that measurement when there is one for this machine.
The caller's count comes back when the engine runs out of work (:class:`StepThreads`).
"""

from __future__ import annotations

import torch

#: Steps of at most this many tokens run on one thread under ``cpu_threads="auto"``.
SMALL_STEP_TOKENS = 4


def threads_for_step(setting: int | str, num_tokens: int, default: int, small: int = SMALL_STEP_TOKENS) -> int:
    """Threads for a step of ``num_tokens`` tokens under ``setting`` (``"auto"`` or a count): under "auto",
    one for steps of up to ``small`` tokens (measured on the machine by ``python -m minipd build-kernels``
    when it was run, see :func:`minipd.engine.measure.measure_small_step_tokens`), else ``default``."""
    if setting == "auto":
        return 1 if num_tokens <= small else default
    return int(setting)


class StepThreads:
    """Sets torch's thread count for a step and gives the caller's back once the engine is idle.

    Changing the count costs a re-spin of the OpenMP pool (about 0.15 ms here), so consecutive
    steps that want the same count change nothing, and the caller's count is restored once per
    run (when no request is left) rather than after every step: between the steps of a run, code
    that shares the process sees the engine's count.
    """

    def __init__(self) -> None:
        self._caller: int | None = None

    def enter(self, count: int) -> None:
        """Run the coming step on ``count`` threads."""
        current = torch.get_num_threads()
        if count != current:
            if self._caller is None:
                self._caller = current
            torch.set_num_threads(count)

    def restore(self) -> None:
        """Give back the count the caller had before the run's first change (no-op when nothing changed)."""
        if self._caller is not None:
            torch.set_num_threads(self._caller)
            self._caller = None
