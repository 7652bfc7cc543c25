"""The coordinator: Ray Train's ``TrainController`` driving one worker group per module.

It is an asyncio actor started exactly like Ray Train's controller (no CPU, pinned to the
driver node). Only worker-group creation differs: instead of one ``WorkerGroup`` it starts
a :class:`ModuleWorkerGroups`. Failure handling (``FailureConfig``), checkpoint
bookkeeping (``CheckpointConfig``), callbacks, abort and the ``Result`` are Ray Train's.
"""

from __future__ import annotations

from ray_disagg._internal.ray_compat import TrainController
from ray_disagg._internal.worker_groups import GroupLaunch, ModuleWorkerGroups


class DisaggregatedController(TrainController):
    def __init__(self, *, launches: dict[str, GroupLaunch], side_timeout_s: float, **kwargs):
        self._launches = launches
        self._side_timeout_s = side_timeout_s
        super().__init__(**kwargs)

    def _start_worker_group(self, num_workers: int, resources_per_worker: dict) -> None:
        # The union scaling config only sizes autoscaler requests; each group uses its own.
        self._worker_group = ModuleWorkerGroups.create(
            launches=self._launches,
            train_run_context=self._train_run_context,
            run_attempt_id=self._get_run_attempt_id(),
            callbacks=self._worker_group_callbacks_to_propagate,
            side_timeout_s=self._side_timeout_s,
        )
