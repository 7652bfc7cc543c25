"""What the module groups need from the cluster, checked on the driver before any worker
starts, and the placement-group janitor that removes every group's reservation when the
coordinator dies."""

from __future__ import annotations

import logging
from collections import defaultdict

import ray
from ray.util.placement_group import remove_placement_group

logger = logging.getLogger(__name__)


def demand_lines(groups) -> list[str]:
    lines = []
    for name, g in groups.items():
        sc = g.scaling_config
        per = dict(sc._resources_per_worker_not_none)
        lines.append(f"{name}: {sc.num_workers} x {per} ({sc.placement_strategy})")
    return lines


def check_cluster_capacity(groups, wait_for_resources: bool) -> None:
    """``ValueError`` when the groups together cannot be placed on the cluster as it is
    (unless ``wait_for_resources``: an autoscaling cluster may grow)."""
    if not ray.is_initialized():
        ray.init()  # what Ray Train would do when it starts the controller
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = defaultdict(float)
    for node in nodes:
        for k, v in node.items():
            total[k] += v
    demand: dict[str, float] = defaultdict(float)
    problems = []
    for name, g in groups.items():
        sc = g.scaling_config
        per = dict(sc._resources_per_worker_not_none)
        for k, v in per.items():
            demand[k] += v * sc.num_workers
        if not any(all(node.get(k, 0) >= v for k, v in per.items()) for node in nodes):
            problems.append(f"no node can hold one {name} worker ({per})")
        if sc.placement_strategy == "STRICT_PACK":
            whole = {k: v * sc.num_workers for k, v in per.items()}
            if not any(all(node.get(k, 0) >= v for k, v in whole.items()) for node in nodes):
                problems.append(f"STRICT_PACK: no node can hold all {name} workers ({whole})")
    for k, v in demand.items():
        if v > total.get(k, 0) + 1e-9:
            problems.append(
                f"{k}: the groups need {v:g} together, the cluster has {total.get(k, 0):g}"
            )
    if problems and not wait_for_resources:
        raise ValueError(
            "The module groups cannot all be placed on this cluster: "
            + "; ".join(problems)
            + ". Demand: "
            + "; ".join(demand_lines(groups))
            + f". Cluster capacity: {dict(total)}. Lower num_workers or resources_per_worker, "
            "or pass DisaggregatedTrainer(wait_for_resources=True) on an autoscaling cluster."
        )
    if problems:
        logger.warning("Waiting for resources the cluster does not have yet: %s", problems)


@ray.remote(num_cpus=0)
class PlacementGroupJanitor:
    """The placement groups of every module group of a run (Ray Train's own cleaner tracks
    one). Owned by the driver, not the coordinator, so it outlives a dead coordinator:
    ``release`` at the end of ``fit()``, however it ends, removes the ones still reserved."""

    def __init__(self):
        self._pgs = []

    def register(self, placement_group) -> None:
        self._pgs.append(placement_group)

    def release(self) -> int:
        removed = 0
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
                removed += 1
            except Exception:  # already removed by its group's shutdown
                pass
        self._pgs.clear()
        return removed
