"""The coordinator's decisions for an elastic group (:mod:`ray_disagg.launch.elastic`):
the size to start with, to restart with after a failure, and when to grow."""

from __future__ import annotations

import logging
import time

from ray_disagg.launch.elastic import (
    ElasticGroup,
    free_per_node,
    free_total,
    workers_fitting,
)
from ray_disagg.launch.launches import Launch
from ray_disagg.launch.ray_compat import resources_per_worker

logger = logging.getLogger(__name__)

__all__ = ["PROBE_TIMEOUT_S", "after_failure", "grow_launch", "initial_launch"]

PROBE_TIMEOUT_S = 5.0
"""How long a size may take to be placed before a smaller one is tried."""


def initial_launch(elastic: ElasticGroup, launch: Launch) -> Launch:
    """Every group's launch for a (re)start of every group: the elastic group at the
    largest allowed size the free resources hold next to the other groups."""
    others: dict[str, float] = {}
    for name, g in launch.groups.items():
        if name != elastic.name:
            sc = g.scaling_config
            for k, v in resources_per_worker(sc).items():
                others[k] = others.get(k, 0.0) + v * sc.num_workers
    elastic.size = elastic.initial_size(free_total(), others, free_per_node())
    elastic.checked_at, elastic.grow_to = time.monotonic(), None
    logger.warning(
        "Starting the elastic %s group with %d workers (sizes %s).",
        elastic.name, elastic.size, elastic.sizes,
    )  # fmt: skip
    return elastic.launches[elastic.size]


def after_failure(elastic: ElasticGroup) -> Launch:
    """After a worker of the elastic group was lost and the group stopped: the launch at
    the largest allowed size up to the current one that can be placed now (it shrinks
    when the lost worker's resources are gone); ``RuntimeError`` when none can."""
    size = elastic.placeable(elastic.size, PROBE_TIMEOUT_S)
    if size is None:
        raise RuntimeError(
            f"no allowed size {elastic.sizes} of the {elastic.name} group can be placed now"
        )
    if size != elastic.size:
        logger.warning(
            "Shrinking the %s group from %d to %d workers (the resources for %d are gone).",
            elastic.name, elastic.size, size, elastic.size,
        )  # fmt: skip
    elastic.size, elastic.checked_at, elastic.grow_to = size, time.monotonic(), None
    return elastic.launches[size]


def grow_launch(elastic: ElasticGroup, latest) -> Launch | None:
    """The launch to grow the elastic group with now, or ``None``. Every
    ``interval_s`` the free resources are checked for a larger allowed size; once seen,
    the group grows right after the next checkpoint is registered (``latest``: Ray
    Train's latest checkpoint result), if that size can still be placed."""
    path = None if latest is None else latest.checkpoint.path
    if latest is not None and latest.metrics.get("step", 0) >= elastic.max_steps:
        return None  # the last checkpoint: the run ends
    if elastic.grow_to is None:
        now = time.monotonic()
        if elastic.size >= elastic.sizes[-1] or now - elastic.checked_at < elastic.interval_s:
            return None
        elastic.checked_at = now
        room = workers_fitting(elastic.per_worker, free_per_node())
        target = elastic.fitting(elastic.size + room)
        if target is not None and target > elastic.size:
            elastic.grow_to, elastic.grow_after = target, path
            logger.warning(
                "Resources for %d workers of the %s group (now %d): it grows after the next "
                "checkpoint.", target, elastic.name, elastic.size,
            )  # fmt: skip
        return None
    if path is None or path == elastic.grow_after:
        return None
    target, elastic.grow_to = elastic.grow_to, None
    if not elastic.probe(target - elastic.size, PROBE_TIMEOUT_S):
        logger.warning("The resources for %d %s workers are gone again.", target, elastic.name)
        elastic.checked_at = time.monotonic()
        return None
    elastic.size, elastic.checked_at = target, time.monotonic()
    return elastic.launches[target]
