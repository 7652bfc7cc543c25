"""The controller: Ray Train's ``TrainController`` driving one worker group per module.

It is an asyncio actor started exactly like Ray Train's controller (no CPU, pinned to the
driver node). Only worker-group creation differs: instead of one ``WorkerGroup`` it
starts a :class:`ModuleWorkerGroups`. Failure handling (``FailureConfig``), checkpoint
bookkeeping (``CheckpointConfig``), callbacks, abort and the ``Result`` are Ray Train's;
what the coordinator adds (a group restarted alone, an elastic group resized, standbys)
is decided by its policies and executed by :class:`~ray_disagg.launch.coordinator.
Coordinator`, which this controller calls at each start and poll.
"""

from __future__ import annotations

from ray_disagg.launch.coordinator import Coordinator
from ray_disagg.launch.launches import Colocation, Launch
from ray_disagg.launch.ray_compat import ControllerBase
from ray_disagg.launch.recovery.elastic import ClusterResources, ElasticGroup, ElasticPolicy
from ray_disagg.launch.recovery.policies import GroupRestartPolicy
from ray_disagg.launch.step_feed import StepFeed
from ray_disagg.launch.worker_groups import ModuleWorkerGroups

__all__ = ["DisaggregatedController"]


class DisaggregatedController(ControllerBase):
    """``failure_policy`` (Ray Train's keyword) must be a
    :class:`~ray_disagg.launch.recovery.policies.GroupFailurePolicy`."""

    def __init__(
        self,
        *,
        launch: Launch,
        side_timeout_s: float,
        start_timeout_s: float,
        demand: list[str],
        elastic: ElasticGroup | None = None,
        colocation: Colocation | None = None,
        restartable: frozenset[str] = frozenset(),
        **kwargs,
    ):
        self.feed = StepFeed()  # every reported step, for the driver (reported_since)
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or ()), self.feed]
        super().__init__(**kwargs)
        self._colocation, self._side_timeout_s = colocation, side_timeout_s
        policy = None
        if elastic is not None:  # its probes reserve under the run's name too
            resources = ClusterResources(self.train_run_context.run_id)
            policy = ElasticPolicy(elastic, resources)
        self.coordinator = Coordinator(
            launch=launch,
            restart=GroupRestartPolicy(restartable, self.failure_policy, policy),
            start_timeout_s=start_timeout_s,
            demand=demand,
        )

    async def reported_since(self, n: int) -> list[dict]:
        """The metrics of every reported step after the first ``n`` (the driver polls)."""
        return self.feed.since(n)

    def start_worker_group(self) -> None:
        # The union scaling config only sizes autoscaler requests; each group uses its own.
        self.set_worker_group(self.coordinator.start(self._create))

    def _create(self, launch: Launch) -> ModuleWorkerGroups:
        return ModuleWorkerGroups.create(
            launches=launch.groups,
            train_run_context=self.train_run_context,
            run_attempt_id=self.run_attempt_id(),
            callbacks=self.worker_group_callbacks,
            side_timeout_s=self._side_timeout_s,
            transfers=launch.transfers,
            colocation=self._colocation,
        )

    def after_poll(self, status):
        groups = self.get_worker_group()
        if not isinstance(groups, ModuleWorkerGroups):
            return status
        return self.coordinator.after_poll(
            groups, status, self.latest_checkpoint_result, self.health_check_interval_s
        )
