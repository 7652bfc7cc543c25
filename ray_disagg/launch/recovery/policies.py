"""The coordinator's policies for failures (Ray Train V2's shape: a policy returns a
decision, the controller executes it).

- :class:`GroupFailurePolicy` is the run's Ray Train ``FailurePolicy``: Ray's default
  one, plus the failures the coordinator handles itself. A failure handled by restarting
  one group is counted when decided (:meth:`~GroupFailurePolicy.count`); when the
  coordinator then hands an error to Ray Train after all (the restart failed, a grow
  failed), it settles Ray's next decision (:meth:`~GroupFailurePolicy.settle`) so that
  nothing is counted twice, or at all for a grow.
- :class:`GroupRestartPolicy` decides whether a failure restarts the failed group alone
  (:class:`~ray_disagg.launch.recovery.decisions.RestartGroup`) or every group (``None``: Ray
  Train's full restart).
"""

from __future__ import annotations

import logging

from ray_disagg.launch.ray_compat import FailureDecision, FailurePolicy, create_failure_policy
from ray_disagg.launch.recovery.decisions import RestartGroup

logger = logging.getLogger(__name__)

__all__ = ["GroupFailurePolicy", "GroupRestartPolicy"]


class GroupFailurePolicy(FailurePolicy):
    """Ray's default failure policy for ``failure_config``, with the coordinator's own
    decisions (see the module docstring)."""

    def __init__(self, failure_config):
        super().__init__(failure_config)
        self._ray = create_failure_policy(failure_config)
        self._settled: FailureDecision | None = None

    def make_decision(self, training_failed_error) -> FailureDecision:
        if self._settled is not None:
            decision, self._settled = self._settled, None
            return decision
        return self._ray.make_decision(training_failed_error)

    def count(self, training_failed_error) -> FailureDecision:
        """Count a failure the coordinator handles (as Ray would): retry or raise."""
        return self._ray.make_decision(training_failed_error)

    def settle(self, decision: FailureDecision) -> None:
        """Ray Train's next decision (on the error status the coordinator returns now)."""
        self._settled = decision


class GroupRestartPolicy:
    """A failure confined to one group of ``restartable`` restarts that group alone, from
    the latest checkpoint, counted against ``max_failures`` like a full restart; an
    elastic group restarts at the size its policy gives once it stopped."""

    def __init__(self, restartable: frozenset[str], failures: GroupFailurePolicy, elastic=None):
        self.restartable, self.failures, self.elastic = restartable, failures, elastic

    def decide(self, failed: set[str], error, latest) -> RestartGroup | None:
        """``failed``: the groups with a failed worker; ``error``: the poll's
        ``WorkerGroupError``; ``latest``: the latest registered checkpoint result."""
        if len(failed) != 1 or not failed <= self.restartable:
            return None
        (name,) = failed
        if latest is None:
            logger.warning("The %s group failed before any checkpoint: every group restarts.", name)
            return None
        decision = self.failures.count(error)
        if decision != FailureDecision.RETRY:
            self.failures.settle(decision)  # Ray Train raises it, not counted twice
            return None
        launch = None
        if self.elastic is not None and name == self.elastic.name:
            launch = self.elastic.after_failure
        return RestartGroup(name, latest.checkpoint, launch)
