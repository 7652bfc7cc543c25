"""Each reported step's headline metrics as Ray metrics (``ray.util.metrics`` gauges,
recorded on the driver), for the Ray dashboard's Grafana panels and any Prometheus that
scrapes the nodes' metrics export port. Ray prefixes every name with ``ray_``:

- ``ray_disagg_{loss,tokens_per_s,mfu,step,step_time_s}``, tagged ``run``;
- ``ray_disagg_group_{mfu,compute_s,wait_s,data_wait_s,peak_memory_mb}``, tagged ``run``
  and ``group``.

A gauge keeps the last step's value; a metric the step did not report (``mfu`` without a
known peak) is left unset.
"""

from __future__ import annotations

import warnings

__all__ = ["RUN_GAUGES", "GROUP_GAUGES", "RayMetrics"]

RUN_GAUGES = ("loss", "tokens_per_s", "mfu", "step", "step_time_s")
GROUP_GAUGES = ("mfu", "compute_s", "wait_s", "data_wait_s", "peak_memory_mb")


class RayMetrics:
    """Gauges of one run (``run``: its name) with the groups ``groups``; :meth:`log`
    takes a reported step's merged metrics."""

    def __init__(self, run: str, groups):
        from ray.util.metrics import Gauge

        self.run, self.groups = run, list(groups)
        self.gauges = {
            k: Gauge(f"disagg_{k}", description=f"ray_disagg: the step's {k}", tag_keys=("run",))
            for k in RUN_GAUGES
        }
        self.group_gauges = {
            k: Gauge(
                f"disagg_group_{k}",
                description=f"ray_disagg: each group's {k} in the step",
                tag_keys=("run", "group"),
            )
            for k in GROUP_GAUGES
        }
        self.failed = False

    def log(self, m: dict) -> None:
        """Set the gauges from step metrics ``m``; a failure warns once and is ignored."""
        if self.failed:
            return
        try:
            for k, gauge in self.gauges.items():
                if k in m:
                    gauge.set(float(m[k]), tags={"run": self.run})
            for k, gauge in self.group_gauges.items():
                for g in self.groups:
                    if f"{g}_{k}" in m:
                        gauge.set(float(m[f"{g}_{k}"]), tags={"run": self.run, "group": g})
        except Exception as e:  # noqa: BLE001 - the run goes on without its gauges
            self.failed = True
            warnings.warn(f"Ray metrics are not recorded: {e!r}", stacklevel=2)
