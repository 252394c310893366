"""Models of an engine's time without running the model: costs and simulated schedules.

- :mod:`minipd.sim.costs`: a roofline cost model of prefill and decode steps on a device (FLOPs and
  bytes per step, GPU and CPU datasheets), used by the chapters' figures;
- :mod:`minipd.sim.roofline`: the same counts as an O(1) step-time model for simulators
  (:class:`~minipd.sim.roofline.RooflineStepTime`: datasheet peaks at stated efficiencies, tensor
  parallelism and its all-reduces, KV capacity) and the interconnects (:class:`~minipd.sim.roofline.Link`);
- :mod:`minipd.sim.batching`: chapter 04's simulator of static, dynamic and continuous batching on a
  step-time model.
"""
