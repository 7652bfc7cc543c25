"""The planner: what a layout of a recipe's model costs, and the best layouts on a
cluster (``ray-disagg plan`` and ``plan --auto``).

- :mod:`~ray_disagg.planner.cluster`: the cluster and its device figures (nominal or
  calibrated);
- :mod:`~ray_disagg.planner.memory`: each worker's memory (``ray-disagg plan``'s
  estimate, the planner's memory model);
- :mod:`~ray_disagg.planner.cost`: one step's time (FLOPs, collectives, crossings, the
  schedule);
- :mod:`~ray_disagg.planner.search`: the layouts enumerated, checked
  (``ray_disagg.config.layout.resolve``) and ranked;
- :mod:`~ray_disagg.planner.calibrate`: the device figures measured on a cluster;
- :mod:`~ray_disagg.planner.render`: the text and the recipe written.

A model's FLOPs and activation formulas come from its adapter's hooks
(``ray_disagg.models.costs``): a new family needs no edit here.
"""
