"""The driver's feed of every reported step, through Ray Train's own report path: each
``ray.train.report`` of a step reaches the coordinator; :class:`StepFeed`, one of its
report callbacks, keeps the metrics of the run's rank 0 (the LLM group's rank 0: the
merged metrics of every group) in order, and the driver takes the new ones with
``DisaggregatedController.reported_since(n)``. No file is read: the driver's progress
lines, summary, Ray gauges, trackers and the metrics history work alike on every storage.

An asynchronous checkpoint's step is reported twice: its metrics at once, then again with
the checkpoint once its files are written (``worker.checkpoint``). The second report,
the same metrics with a checkpoint, is the checkpoint's only: the feed leaves it out.

Example:
    >>> feed = StepFeed()
    >>> feed.add({"step": 1, "loss": 2.0})
    >>> feed.add({"step": 2, "loss": 1.5})
    >>> feed.add({"step": 1, "loss": 2.0}, checkpoint=True)  # step 1's async checkpoint
    >>> [m["loss"] for m in feed.since(1)]
    [1.5]
"""

from __future__ import annotations

import json

from ray_disagg.launch.ray_compat import ReportCallback

__all__ = ["StepFeed"]


class StepFeed(ReportCallback):
    """Every report's metrics of rank 0 that name a step, in the order they came; those
    the driver took are let go (a long run's history stays on the driver's side)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.taken = 0  # the reports before rows[0], taken by the driver
        self.seen: dict[int, int] = {}  # step -> hash of its last metrics fed

    def after_report(self, training_report, metrics: list[dict]) -> None:
        if metrics:
            self.add(metrics[0], checkpoint=training_report.checkpoint is not None)

    def add(self, metrics: dict, checkpoint: bool = False) -> None:
        """``metrics`` of one report (``checkpoint``: it carried one)."""
        if "step" not in metrics:
            return
        key = hash(json.dumps(metrics, sort_keys=True, default=repr))
        if checkpoint and self.seen.get(metrics["step"]) == key:
            return  # an asynchronous checkpoint's report of a step already fed
        self.seen[metrics["step"]] = key
        self.rows.append(dict(metrics))

    def since(self, n: int) -> list[dict]:
        """The reports after the first ``n`` (the driver has taken those: let go)."""
        if n > self.taken:
            del self.rows[: n - self.taken]
            self.taken = n
        return self.rows[max(0, n - self.taken) :]
