"""The coordinator's logic: it starts the groups and, at each poll, asks its policies
for a decision and executes it, in one place (Ray Train V2's shape: a controller
executing the policies' decisions).

- a start: the elastic group at the size its policy gives (:class:`ElasticPolicy`); a
  start that keeps timing out past ``start_timeout_s`` is not retried;
- a failure: :class:`GroupRestartPolicy` restarts the failed group alone
  (:class:`RestartGroup`) or leaves it to Ray Train's full restart (``None``);
- while every worker runs: the standbys are replenished and the elastic policy may grow
  its group (a :class:`RestartGroup` that is not a failure).

Restart and resize are executed the same way (``GroupRecovery.restart`` through the
worker groups' facade); when that fails, every group restarts (Ray Train's way), with
the failure counted once (:class:`GroupFailurePolicy`). It knows Ray only through the
facade and the policies, so its tests drive it with fakes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from ray_disagg.launch.launches import Launch
from ray_disagg.launch.ray_compat import (
    FailureDecision,
    WorkerGroupStartupTimeoutError,
    WorkerStatus,
)
from ray_disagg.launch.recovery.decisions import RestartGroup
from ray_disagg.launch.recovery.elastic import ElasticPolicy
from ray_disagg.launch.recovery.policies import GroupFailurePolicy, GroupRestartPolicy
from ray_disagg.launch.worker_groups import ModulePollStatus

logger = logging.getLogger(__name__)

__all__ = ["Coordinator"]


class Coordinator:
    """Decides and executes for one run (see the module docstring)."""

    def __init__(
        self,
        *,
        launch: Launch,
        restart: GroupRestartPolicy,
        start_timeout_s: float = 600.0,
        demand: tuple[str, ...] = (),
    ):
        self.launch, self.restart = launch, restart
        self.start_timeout_s, self.demand = start_timeout_s, list(demand)
        self._waiting_since: float | None = None

    @property
    def failures(self) -> GroupFailurePolicy:
        """The run's failure policy (the restart policy's)."""
        return self.restart.failures

    @property
    def elastic(self) -> ElasticPolicy | None:
        """The elastic group's policy (the restart policy's), or ``None``."""
        return self.restart.elastic

    def start(self, create: Callable[[Launch], object]):
        """The started worker groups: ``create(launch)`` with every group's launch (an
        elastic group at the size its policy gives)."""
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        if self.elastic is not None:
            self.launch = self.elastic.initial_launch(self.launch)
        try:
            groups = create(self.launch)
        except WorkerGroupStartupTimeoutError as e:
            if self.elastic is not None:  # the free resources were not where they looked
                self.elastic.start_timed_out()
            waited = time.monotonic() - self._waiting_since
            if waited >= self.start_timeout_s:  # not retryable: fit() raises this
                raise TimeoutError(
                    f"The module groups could not start within start_timeout_s="
                    f"{self.start_timeout_s:g}s; still waiting for: {'; '.join(self.demand)}."
                    " Free or add resources, or lower the groups' demand."
                ) from e
            logger.warning("Waiting for resources (%.0fs so far): %s", waited,
                           "; ".join(self.demand))  # fmt: skip
            raise
        self._waiting_since = None
        return groups

    def after_poll(self, groups, status, latest, poll_timeout_s: float):
        """The poll status Ray Train's state machine sees after this poll of ``groups``
        (``latest``: the latest registered checkpoint result)."""
        if status.errors:
            error = status.get_worker_group_error()
            decision = self.restart.decide(groups.failed_groups(status), error, latest)
            if decision is None:
                return status
            logger.warning("The %s group failed: restarting it alone.\n%s", decision.name, error)
            return self.execute(groups, decision, status, poll_timeout_s)
        groups.recovery.replenish(latest)
        running = all(s.running for s in status.worker_statuses.values())
        if self.elastic is None or not running or status.finished:
            return status
        try:
            decision = self.elastic.decide(latest)
        except Exception:  # the resource view or a probe: try again at the next poll
            logger.warning("Checking whether the %s group can grow failed.", self.elastic.name,
                           exc_info=True)  # fmt: skip
            return status
        return (
            status if decision is None else self.execute(groups, decision, status, poll_timeout_s)
        )

    def execute(self, groups, decision: RestartGroup, status, poll_timeout_s: float):
        """Restart (or resize) one group; the poll status after it, or one that makes Ray
        Train restart every group when it failed."""
        decision = self._tracking_launch(decision)
        try:
            took = groups.recovery.restart(groups, decision)
        except Exception as e:
            self.failures.settle(FailureDecision.RETRY)  # counted once (a grow: never)
            if decision.failure:
                logger.warning("Restarting the %s group alone failed; every group restarts.",
                               decision.name, exc_info=True)  # fmt: skip
                return status
            logger.warning("Growing the %s group failed; every group restarts (not counted "
                           "as a failure).", decision.name, exc_info=True)  # fmt: skip
            err = RuntimeError(f"growing the {decision.name} group from {decision.old} "
                               f"workers failed: {e!r}")  # fmt: skip
            return ModulePollStatus(worker_statuses={0: WorkerStatus(running=False, error=err)})
        self._log(groups, decision, took)
        return groups.poll_status(timeout=poll_timeout_s)

    def _tracking_launch(self, decision: RestartGroup) -> RestartGroup:
        """The decision whose launch, once known, is also the one later full restarts use."""
        chosen = decision.launch
        if chosen is None:
            return decision
        if not callable(chosen):
            self.launch = chosen
            return decision

        def launch():
            self.launch = chosen()
            return self.launch

        return dataclasses.replace(decision, launch=launch)

    def _log(self, groups, decision: RestartGroup, took: dict) -> None:
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in took.items())
        path = decision.checkpoint.path
        if decision.failure:
            logger.warning(
                "Restarted the %s group alone in %.1fs (%s; restart %d); the other groups "
                "kept their workers and continue from %s.", decision.name, sum(took.values()),
                phases, groups.recovery.restarts[decision.name], path,
            )  # fmt: skip
        else:
            logger.warning(
                "Resized the %s group from %d to %d workers in %.1fs (resources appeared); "
                "the other groups kept their workers and continue from %s.", decision.name,
                decision.old, self.elastic.group.size, sum(took.values()), path,
            )  # fmt: skip
