"""How many CPU threads a step gets (``cpu_threads=``).

A step of a few tokens (one or two streams decoding) is a string of small matrix products: splitting
each over two threads costs a fork/join per product and buys little, and when the machine is busy
a second thread mostly waits for a core. Big steps (prefill chunks, large decode batches) do gain
from every core. ``"auto"`` therefore runs steps of up to :data:`SMALL_STEP_TOKENS` tokens on one thread
and bigger ones on the threads torch had when the engine was built; a number fixes the count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Steps of at most this many tokens run on one thread under ``cpu_threads="auto"``.
SMALL_STEP_TOKENS = 4


def threads_for_step(setting: int | str, num_tokens: int, default: int) -> int:
    """Threads for a step of ``num_tokens`` tokens under ``setting`` (``"auto"`` or a count)."""
    if setting == "auto":
        return 1 if num_tokens <= SMALL_STEP_TOKENS else default
    return int(setting)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(count)``, then restore the caller's count."""
    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
