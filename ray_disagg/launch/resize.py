"""The coordinator's policy for an elastic group (:mod:`ray_disagg.launch.elastic`): the
size to start with, to restart with after a failure, and when to grow. It owns the
group's state (:class:`ElasticGroup`) and asks the cluster through a
``ClusterResources`` (Ray's view; the tests give a fake one)."""

from __future__ import annotations

import logging
import time

from ray_disagg.launch.decisions import RestartGroup
from ray_disagg.launch.elastic import ClusterResources, ElasticGroup, workers_fitting
from ray_disagg.launch.launches import Launch
from ray_disagg.launch.ray_compat import resources_per_worker

logger = logging.getLogger(__name__)

__all__ = ["PROBE_TIMEOUT_S", "ElasticPolicy"]

PROBE_TIMEOUT_S = 5.0
"""How long a size may take to be placed before a smaller one is tried."""


class ElasticPolicy:
    """Decides the elastic group's size: at each start of every group
    (:meth:`initial_launch`), after it lost a worker (:meth:`after_failure`) and while it
    runs (:meth:`decide`: grow or nothing)."""

    def __init__(self, group: ElasticGroup, resources: ClusterResources):
        self.group = group
        self.resources = resources

    @property
    def name(self) -> str:
        return self.group.name

    def initial_launch(self, launch: Launch) -> Launch:
        """Every group's launch for a (re)start of every group: the elastic group at the
        largest allowed size the free resources hold next to the other groups."""
        g, others = self.group, {}
        for name, launch_ in launch.groups.items():
            if name != g.name:
                sc = launch_.scaling_config
                for k, v in resources_per_worker(sc).items():
                    others[k] = others.get(k, 0.0) + v * sc.num_workers
        free = self.resources.free_total()
        g.size = g.initial_size(free, others, self.resources.free_per_node())
        g.checked_at, g.grow_to = time.monotonic(), None
        logger.warning("Starting the elastic %s group with %d workers (sizes %s).",
                       g.name, g.size, g.sizes)  # fmt: skip
        return g.launches[g.size]

    def start_timed_out(self) -> None:
        """The groups' start timed out: the free resources were not where they looked."""
        self.group.step_down()

    def after_failure(self) -> Launch:
        """After a worker of the elastic group was lost and the group stopped: the launch
        at the largest allowed size up to the current one that can be placed now (it
        shrinks when the lost worker's resources are gone); ``RuntimeError`` when none
        can."""
        g = self.group
        size = self._placeable(g.size)
        if size is None:
            raise RuntimeError(f"no allowed size {g.sizes} of the {g.name} group can be placed now")
        if size != g.size:
            logger.warning(
                "Shrinking the %s group from %d to %d workers (the resources for %d are "
                "gone).", g.name, g.size, size, g.size,
            )  # fmt: skip
        g.size, g.checked_at, g.grow_to = size, time.monotonic(), None
        return g.launches[size]

    def decide(self, latest) -> RestartGroup | None:
        """Grow now (a restart of the group at a larger size, not a failure), or ``None``.
        Every ``interval_s`` the free resources are checked for a larger allowed size;
        once seen, the group grows right after the next checkpoint is registered
        (``latest``: Ray Train's latest checkpoint result), if that size can still be
        placed."""
        g = self.group
        path = None if latest is None else latest.checkpoint.path
        if latest is not None and latest.metrics.get("step", 0) >= g.max_steps:
            return None  # the last checkpoint: the run ends
        if g.grow_to is None:
            self._look_for_room(path)
            return None
        if path is None or path == g.grow_after:
            return None
        target, g.grow_to = g.grow_to, None
        if not self.resources.probe(g.per_worker, target - g.size, g.strategy, PROBE_TIMEOUT_S):
            logger.warning("The resources for %d %s workers are gone again.", target, g.name)
            g.checked_at = time.monotonic()
            return None
        old, g.size, g.checked_at = g.size, target, time.monotonic()
        return RestartGroup(g.name, latest.checkpoint, g.launches[target], failure=False, old=old)

    def _look_for_room(self, path: str | None) -> None:
        g, now = self.group, time.monotonic()
        if g.size >= g.sizes[-1] or now - g.checked_at < g.interval_s:
            return
        g.checked_at = now
        room = workers_fitting(g.per_worker, self.resources.free_per_node())
        target = g.fitting(g.size + room)
        if target is not None and target > g.size:
            g.grow_to, g.grow_after = target, path
            logger.warning(
                "Resources for %d workers of the %s group (now %d): it grows after the next "
                "checkpoint.", target, g.name, g.size,
            )  # fmt: skip

    def _placeable(self, below: int) -> int | None:
        """The largest allowed size up to ``below`` that can be placed now (after the
        group stopped), trying the sizes from the largest down."""
        g = self.group
        for n in reversed([n for n in g.sizes if n <= below]):
            if self.resources.probe(g.per_worker, n, g.strategy, PROBE_TIMEOUT_S):
                return n
        return None
