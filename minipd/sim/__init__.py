"""Models of an engine's time without running the model: costs and simulated schedules.

- :mod:`minipd.sim.costs`: a roofline cost model of prefill and decode steps on a device (FLOPs and
  bytes per step, GPU and CPU datasheets), used by the chapters' figures;
- :mod:`minipd.sim.roofline`: the same counts as an O(1) step-time model for simulators
  (:class:`~minipd.sim.roofline.RooflineStepTime`: datasheet peaks at stated efficiencies, tensor
  parallelism and its all-reduces, KV capacity) and the interconnects (:class:`~minipd.sim.roofline.Link`);
- :mod:`minipd.sim.batching`: chapter 04's simulator of static, dynamic and continuous batching on a
  step-time model;
- the cluster simulator of chapter 05b: :mod:`~minipd.sim.instance` (an instance running the engine's own
  scheduler on a step-time model and a simulated clock), :mod:`~minipd.sim.cluster` (arrivals, router,
  colocated or prefill/decode instances, the KV link, on simpy), :mod:`~minipd.sim.fitted` (step times
  fitted to a real run), :mod:`~minipd.sim.search` (goodput, placements), :mod:`~minipd.sim.calibrate` (the
  roofline fitted to a paper's published goodputs), :mod:`~minipd.sim.sharing` (instances slowing each other
  down on one machine's cores), :mod:`~minipd.sim.validate`
  (real runs beside simulated ones) and :mod:`~minipd.sim.cli` (``python -m minipd simulate``).
"""
