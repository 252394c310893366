"""Mixture-of-experts building blocks: router → dispatcher → stacked experts → combine.

:class:`minipd.layers.moe.MoE` composes them. Each piece is swappable on its own: the router by model
family, the dispatcher for expert parallelism, the experts' matmul path by device.
"""

from minipd.moe.dispatch import Dispatcher, ExpertBatch, LocalDispatcher, LocalExpertBatch
from minipd.moe.experts import StackedExperts, grouped_mm_supported
from minipd.moe.router import Router, SigmoidGroupedRouter, SoftmaxRouter, sigmoid_grouped_topk, softmax_topk

__all__ = [
    "Dispatcher",
    "ExpertBatch",
    "LocalDispatcher",
    "LocalExpertBatch",
    "Router",
    "SigmoidGroupedRouter",
    "SoftmaxRouter",
    "StackedExperts",
    "grouped_mm_supported",
    "sigmoid_grouped_topk",
    "softmax_topk",
]
