"""The coordinator: Ray Train's ``TrainController`` driving one worker group per module.

It is an asyncio actor started exactly like Ray Train's controller (no CPU, pinned to the
driver node). Only worker-group creation differs: instead of one ``WorkerGroup`` it starts
a :class:`ModuleWorkerGroups`. Failure handling (``FailureConfig``), checkpoint
bookkeeping (``CheckpointConfig``), callbacks, abort and the ``Result`` are Ray Train's.
"""

from __future__ import annotations

import logging
import time

from ray_disagg.launch.ray_compat import TrainController, WorkerGroupStartupTimeoutError
from ray_disagg.launch.worker_groups import (
    Colocation,
    GroupLaunch,
    ModuleWorkerGroups,
    Transfers,
)

logger = logging.getLogger(__name__)


class DisaggregatedController(TrainController):
    def __init__(
        self,
        *,
        launches: dict[str, GroupLaunch],
        side_timeout_s: float,
        start_timeout_s: float,
        demand: list[str],
        transfers: Transfers,
        colocation: Colocation | None = None,
        janitor=None,
        **kwargs,
    ):
        self._launches = launches
        self._transfers, self._colocation = transfers, colocation
        self._side_timeout_s = side_timeout_s
        self._start_timeout_s = start_timeout_s
        self._demand = demand
        self._janitor = janitor
        self._waiting_since: float | None = None
        super().__init__(**kwargs)

    def _start_worker_group(self, num_workers: int, resources_per_worker: dict) -> None:
        # The union scaling config only sizes autoscaler requests; each group uses its own.
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        try:
            self._worker_group = ModuleWorkerGroups.create(
                launches=self._launches,
                train_run_context=self._train_run_context,
                run_attempt_id=self._get_run_attempt_id(),
                callbacks=self._worker_group_callbacks_to_propagate,
                side_timeout_s=self._side_timeout_s,
                transfers=self._transfers,
                colocation=self._colocation,
                janitor=self._janitor,
            )
        except WorkerGroupStartupTimeoutError as e:
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
        self._waiting_since = None
