"""The attention a layer calls: causal scaled-dot-product attention of new queries against all keys and
values so far, with an optional sliding window.

Layers call :func:`attention` directly when there is no cache, and otherwise hand q, k and v to the
cache's ``attend``: a contiguous cache appends and calls :func:`attention`, the paged cache stores K/V
into its blocks and runs the paged kernels of the chosen backend. Layers never look inside. The
function and its mask are the kernels' torch reference (:mod:`minipd.kernels.attention`), defined there
so that kernels do not import from the layers above them.
"""

from minipd.kernels.attention import attention, causal_mask

__all__ = ["attention", "causal_mask"]
