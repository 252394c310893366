"""Measuring what a change costs in quality, on a whole engine: harnesses that sit above the engine and drive
``LLM`` the way a reader would.

- :mod:`minipd.evaluation.kv_quality`: perplexity, KL to the full-precision model, greedy agreement and copy
  probes for compressed KV caches (``python -m minipd kvquality``).
- :mod:`minipd.evaluation.moe_balance`: how unevenly a MoE model loads its experts, and what capping costs
  (``python -m minipd moebalance``).
- :mod:`minipd.evaluation.router_training`: fine-tuning routers for balance (auxiliary loss, loss-free bias).

Kept apart from the parts they measure so that those (the KV formats in :mod:`minipd.kv`, the routers in
:mod:`minipd.moe`) never import the engine above them. Import the submodules directly.
"""
