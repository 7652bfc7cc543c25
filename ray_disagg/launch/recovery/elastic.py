"""Elastic encoder groups: ``ScalingConfig(num_workers=(min, max))``.

A data-parallel encoder group may change its number of workers during the run. Each
size it may take divides the per-microbatch share of the global batch (so the batch, the
loss's math and every other group stay those of a fixed-size run); the driver lists them
and builds every group's launch at each size before the run. The coordinator then:

- starts the group at the largest allowed size the free resources hold (at least the
  smallest allowed);
- grows it when resources for a larger size appear (checked every
  ``ScalingConfig(elastic_resize_monitor_interval_s)``), right after the next checkpoint
  is registered;
- shrinks it when a worker is lost and its resources do not come back: the group
  restarts alone at the largest size that can be placed.

A resize is a group restart (:mod:`ray_disagg.launch.recovery.survivors`) at another size:
the LLM group keeps its workers and continues from the latest checkpoint.

The driver's side: :func:`elastic_ranges` and :func:`elastic_sizes` (checked and listed
before the run); the coordinator's: :class:`ElasticPolicy`, which owns each elastic
group's state (:class:`ElasticGroup`) and asks the cluster through a
:class:`ClusterResources` (Ray's view; the tests give a fake one).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import remove_placement_group

from ray_disagg.config.groups import DataParallel
from ray_disagg.launch.launches import Launch
from ray_disagg.launch.ray_compat import resources_per_worker
from ray_disagg.launch.recovery.decisions import RestartGroup
from ray_disagg.launch.reservations import reserve

logger = logging.getLogger(__name__)

__all__ = [
    "PROBE_TIMEOUT_S",
    "ClusterResources",
    "ElasticGroup",
    "ElasticPolicy",
    "allowed_sizes",
    "elastic_ranges",
    "elastic_sizes",
    "workers_fitting",
]


@dataclass
class ElasticGroup:
    """The elastic group of a run (built on the driver, used by the coordinator)."""

    name: str
    launches: dict[int, Launch]
    """Per allowed size (ascending), every group's launch at that size."""
    per_worker: dict[str, float]
    strategy: str = "PACK"
    interval_s: float = 60.0
    """``ScalingConfig(elastic_resize_monitor_interval_s)``: how often to look for room
    to grow."""
    size: int = 0
    """The current size (0 before the first start)."""
    grow_to: int | None = None
    """A larger size resources were seen for: taken at the next registered checkpoint."""
    grow_after: str | None = None
    """The latest checkpoint's path when ``grow_to`` was decided."""
    checked_at: float = field(default=-math.inf)
    max_steps: int = 0
    """The run's last step: its checkpoint ends the run, no grow follows it."""
    cap: int | None = None
    """The largest size to start with (lowered after a start that timed out)."""

    @property
    def sizes(self) -> list[int]:
        return sorted(self.launches)

    def fitting(self, count: int) -> int | None:
        """The largest allowed size of at most ``count`` workers (``None``: none)."""
        fit = [n for n in self.sizes if n <= count]
        return fit[-1] if fit else None

    def initial_size(self, available: dict, others: dict, nodes: list[dict] | None = None) -> int:
        """At a start of every group: the largest allowed size (up to ``cap``) that the
        cluster's free resources ``available`` hold once the other groups' demand
        ``others`` is taken, and that the free resources of each node (``nodes``) hold
        together; the smallest allowed size when even that does not fit (the start then
        waits)."""
        free = {k: available.get(k, 0.0) - others.get(k, 0.0) for k in self.per_worker}
        count = workers_fitting(self.per_worker, [free])
        if nodes is not None:
            count = min(count, workers_fitting(self.per_worker, nodes))
        if self.cap is not None:
            count = min(count, self.cap)
        return self.fitting(count) or self.sizes[0]

    def step_down(self) -> None:
        """A start at the current size timed out: start next time one size smaller."""
        smaller = [n for n in self.sizes if n < self.size]
        self.cap = smaller[-1] if smaller else self.sizes[0]


def allowed_sizes(lo: int, hi: int, share: int) -> list[int]:
    """Group sizes in ``[lo, hi]`` that divide ``share`` (the samples of one microbatch).

    Example:
        >>> allowed_sizes(1, 6, 4)
        [1, 2, 4]
    """
    return [n for n in range(lo, hi + 1) if share % n == 0]


def elastic_ranges(groups: dict, adapter, placement: str, restartable) -> dict[str, tuple]:
    """The groups given ``ScalingConfig(num_workers=(min, max))``, validated:
    ``ValueError`` unless each is a data-parallel encoder group that restarts alone."""
    ranges = {
        n: tuple(g.scaling_config.num_workers)
        for n, g in groups.items()
        if g.scaling_config.elasticity_enabled
    }
    if not ranges:
        return ranges
    can = [
        n
        for n in adapter.encoder_parts
        if n in restartable and isinstance(groups[n].parallelism, DataParallel)
    ]
    for n, (lo, hi) in ranges.items():
        reason = _not_elastic(n, groups[n], adapter, placement, restartable, len(ranges))
        if reason:
            raise ValueError(
                f"ScalingConfig(num_workers=({lo}, {hi})) on {reason}. Elastic groups can be "
                f"{can if placement == 'separate' else []} here: data-parallel encoder groups "
                "that restart alone (one encoder group, map-style data, "
                "restart_failed_group=True, placement='separate'). Give the others a fixed "
                "num_workers."
            )
    return ranges


def _not_elastic(name, group, adapter, placement, restartable, count) -> str | None:
    """Why group ``name`` cannot be elastic (``None``: it can)."""
    if name == adapter.llm_part:
        return "the LLM group, which keeps its size (the other groups rejoin it)"
    if not isinstance(group.parallelism, DataParallel):
        kind = type(group.parallelism).__name__
        return f"group {name!r}: its {kind} degree cannot change with its size"
    if placement != "separate":
        return f"group {name!r}: colocated groups share their bundles, one worker each"
    if name not in restartable:
        return f"group {name!r}: it cannot restart alone here"
    if count > 1:
        return f"group {name!r}: only one group may be elastic"
    sc = group.scaling_config
    if sc.placement_strategy.startswith("STRICT") or sc.label_selector is not None:
        what = "label_selector" if sc.label_selector is not None else sc.placement_strategy
        return f"group {name!r}: its size is chosen from the free resources, not with {what}"
    return None


def elastic_sizes(ranges: dict[str, tuple], cfg) -> dict[str, list[int]]:
    """Per elastic group, the sizes of its range that divide the per-microbatch share
    of the global batch (``global_batch_size / micro_batches``), logged on the driver;
    ``ValueError`` when none does. Under a token budget every size of the range (the
    encoder replicas' shares are filled per step)."""
    share = cfg.global_batch_size // cfg.micro_batches
    if ranges and cfg.checkpoint_every is None:
        raise ValueError(
            f"The elastic group(s) {list(ranges)} resize by continuing from a checkpoint: "
            "set train_loop_config['checkpoint_every'] (e.g. every few steps)."
        )
    out = {}
    for name, (lo, hi) in ranges.items():
        if cfg.max_tokens_per_microbatch is not None:  # steps are filled, any size splits
            out[name] = list(range(lo, hi + 1))
            continue
        sizes = allowed_sizes(lo, hi, share)
        unit = f"global_batch_size={cfg.global_batch_size}" + (
            f" / micro_batches={cfg.micro_batches}" if cfg.micro_batches > 1 else ""
        )
        if not sizes:
            raise ValueError(
                f"ScalingConfig(num_workers=({lo}, {hi})) on the {name!r} group: no size in "
                f"that range divides the {share} samples of a microbatch ({unit}); the "
                f"sizes that do are {allowed_sizes(1, share, share)}."
            )
        left_out = sorted(set(range(lo, hi + 1)) - set(sizes))
        say = logger.warning if left_out else logger.info
        say(
            "The elastic %s group takes the sizes %s (they divide the %d samples of a "
            "microbatch, %s)%s.", name, sizes, share, unit,
            f"; not {left_out}" if left_out else "",
        )  # fmt: skip
        out[name] = sizes
    return out


def workers_fitting(per_worker: dict, nodes: list[dict]) -> int:
    """How many workers needing ``per_worker`` the free resources of ``nodes`` hold.

    Example:
        >>> workers_fitting({"CPU": 0.5}, [{"CPU": 1.2}, {"CPU": 0.5}])
        3
    """
    need = {k: v for k, v in per_worker.items() if v > 0}
    if not need:
        return 1 << 30
    return sum(int(min(node.get(k, 0.0) / v + 1e-9 for k, v in need.items())) for node in nodes)


class ClusterResources:
    """What the elastic policy asks of the cluster (Ray's view of it): the free resources,
    and whether some workers can be placed now (a probe reserved under run ``run_id``'s
    name, ``ray_disagg.launch.reservations``)."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def free_total(self) -> dict:
        return dict(ray.available_resources())

    def free_per_node(self) -> list[dict]:
        """Each alive node's free resources (refreshed within about a second)."""
        from ray_disagg.launch.ray_compat import available_resources_per_node

        return available_resources_per_node()

    def probe(self, per_worker: dict, count: int, strategy: str, timeout_s: float) -> bool:
        """Whether ``count`` workers needing ``per_worker`` can be placed now (a placement
        group reserved and released)."""
        if count <= 0:
            return True
        pg = reserve([dict(per_worker)] * count, strategy, self.run_id, "probe")
        try:
            return bool(pg.wait(timeout_seconds=timeout_s))
        finally:
            remove_placement_group(pg)


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
