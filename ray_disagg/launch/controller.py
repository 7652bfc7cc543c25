"""The coordinator: Ray Train's ``TrainController`` driving one worker group per module.

It is an asyncio actor started exactly like Ray Train's controller (no CPU, pinned to the
driver node). Only worker-group creation differs: instead of one ``WorkerGroup`` it starts
a :class:`ModuleWorkerGroups`. Failure handling (``FailureConfig``), checkpoint
bookkeeping (``CheckpointConfig``), callbacks, abort and the ``Result`` are Ray Train's,
with one addition: a failure confined to a group in ``restartable`` restarts that group
alone (:mod:`ray_disagg.launch.group_restart`), counted against ``max_failures`` like a
full restart.
"""

from __future__ import annotations

import logging
import time

from ray_disagg.launch import resize, standby
from ray_disagg.launch.elastic import ElasticGroup
from ray_disagg.launch.group_restart import restart_group
from ray_disagg.launch.launches import Colocation, Launch
from ray_disagg.launch.ray_compat import (
    ControllerBase,
    FailureDecision,
    WorkerGroupStartupTimeoutError,
    WorkerStatus,
)
from ray_disagg.launch.worker_groups import ModulePollStatus, ModuleWorkerGroups

logger = logging.getLogger(__name__)


class DisaggregatedController(ControllerBase):
    def __init__(
        self,
        *,
        launch: Launch,
        side_timeout_s: float,
        start_timeout_s: float,
        demand: list[str],
        elastic: ElasticGroup | None = None,
        colocation: Colocation | None = None,
        janitor=None,
        restartable: frozenset[str] = frozenset(),
        **kwargs,
    ):
        self._launch, self._elastic = launch, elastic
        self._restartable = restartable
        self._colocation = colocation
        self._side_timeout_s = side_timeout_s
        self._start_timeout_s = start_timeout_s
        self._demand = demand
        self._janitor = janitor
        self._waiting_since: float | None = None
        super().__init__(**kwargs)

    def start_worker_group(self) -> None:
        # The union scaling config only sizes autoscaler requests; each group uses its own.
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        if self._elastic is not None:
            self._launch = resize.initial_launch(self._elastic, self._launch)
        try:
            groups = ModuleWorkerGroups.create(
                launches=self._launch.groups,
                train_run_context=self.train_run_context,
                run_attempt_id=self.run_attempt_id(),
                callbacks=self.worker_group_callbacks,
                side_timeout_s=self._side_timeout_s,
                transfers=self._launch.transfers,
                colocation=self._colocation,
                janitor=self._janitor,
            )
        except WorkerGroupStartupTimeoutError as e:
            if self._elastic is not None:  # the free resources were not where they looked
                self._elastic.step_down()
            waited = time.monotonic() - self._waiting_since
            if waited >= self._start_timeout_s:  # not retryable: fit() raises this
                raise TimeoutError(
                    f"The module groups could not start within start_timeout_s="
                    f"{self._start_timeout_s:g}s; still waiting for: {'; '.join(self._demand)}."
                    " Free or add resources, or lower the groups' demand."
                ) from e
            logger.warning(
                "Waiting for resources (%.0fs so far): %s", waited, "; ".join(self._demand)
            )
            raise
        self.set_worker_group(groups)
        self._waiting_since = None

    def after_poll(self, status):
        if not isinstance(self.get_worker_group(), ModuleWorkerGroups):
            return status
        if status.errors:
            return self._maybe_restart_group(status)
        standby.replenish(self.get_worker_group(), self.latest_checkpoint_result)
        running = all(s.running for s in status.worker_statuses.values())
        if self._elastic is not None and running and not status.finished:
            return self._maybe_grow() or status
        return status

    def _maybe_restart_group(self, status):
        """Restart the one failed group alone when it may be, else return ``status`` (Ray
        Train then restarts every group, or raises)."""
        groups = self.get_worker_group()
        failed = groups.failed_groups(status)
        if len(failed) != 1 or not failed <= self._restartable:
            return status
        (name,) = failed
        latest = self.latest_checkpoint_result
        if latest is None:
            logger.warning("The %s group failed before any checkpoint: every group restarts.", name)
            return status
        error = status.get_worker_group_error()
        if self.failure_policy.make_decision(training_failed_error=error) != FailureDecision.RETRY:
            self.uncount_failure()  # the controller decides (and counts) it again
            return status
        logger.warning("The %s group failed: restarting it alone.\n%s", name, error)
        try:
            took = restart_group(groups, name, latest.checkpoint, self._sized(name))
        except Exception:
            logger.warning("Restarting the %s group alone failed; every group restarts.",
                           name, exc_info=True)  # fmt: skip
            self.uncount_failure()
            return status
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in took.items())
        logger.warning(
            "Restarted the %s group alone in %.1fs (%s; restart %d); the other groups kept "
            "their workers and continue from %s.", name, sum(took.values()), phases,
            groups.restarts[name], latest.checkpoint.path,
        )  # fmt: skip
        return groups.poll_status(timeout=self.health_check_interval_s)

    def _sized(self, name: str):
        """For an elastic group: a function giving the launch to restart with once the
        group stopped (the largest size that can be placed then: it shrinks when the lost
        worker's resources are gone)."""
        if self._elastic is None or name != self._elastic.name:
            return None

        def launch():
            self._launch = resize.after_failure(self._elastic)
            return self._launch

        return launch

    def _maybe_grow(self):
        """Grow the elastic group when resources for a larger size appeared, right after
        the next checkpoint is registered; returns the poll status after growing (one
        with an error, for a full restart, when growing failed), else ``None``."""
        latest = self.latest_checkpoint_result
        old, name = self._elastic.size, self._elastic.name
        try:
            launch = resize.grow_launch(self._elastic, latest)
        except Exception:  # the resource view or a probe: try again at the next check
            logger.warning("Checking whether the %s group can grow failed.", name, exc_info=True)
            return None
        if launch is None:
            return None
        try:
            took = restart_group(self.get_worker_group(), name, latest.checkpoint, launch, False)
        except Exception as e:
            logger.warning("Growing the %s group failed; every group restarts (not counted "
                           "as a failure).", name, exc_info=True)  # fmt: skip
            self.uncount_failure(ahead=True)
            err = RuntimeError(f"growing the {name} group from {old} workers failed: {e!r}")
            return ModulePollStatus(worker_statuses={0: WorkerStatus(running=False, error=err)})
        self._launch = launch
        logger.warning(
            "Resized the %s group from %d to %d workers in %.1fs (resources appeared); the "
            "other groups kept their workers and continue from %s.", name, old,
            self._elastic.size, sum(took.values()), latest.checkpoint.path,
        )  # fmt: skip
        return self.get_worker_group().poll_status(timeout=self.health_check_interval_s)
