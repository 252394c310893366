"""Serving (chapter 08): the OpenAI-compatible server over ``AsyncLLM`` (:mod:`minipd.serve.app`, run by
``python -m minipd serve``), its Prometheus metrics under vLLM's names, and a load generator with latency
percentiles and goodput (``python -m minipd loadgen``). Import the submodules directly.
"""
