"""Ray Train's classes whose private hooks ray_disagg overrides, with those hooks
under public names: the coordinator's controller, the trainer, a worker group that
schedules into a placement group shared with other groups and one whose placement group
carries a given name."""

from __future__ import annotations

import logging

from ray.train.v2._internal.execution.context import TrainRunContext
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.worker_group import WorkerGroup
from ray.train.v2._internal.execution.worker_group.placement_group_handle import (
    DefaultPlacementGroupHandle,
)
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.util.placement_group import placement_group

logger = logging.getLogger(__name__)

__all__ = [
    "ControllerBase",
    "NamedPlacementWorkerGroup",
    "SharedPlacementWorkerGroup",
    "TrainerBase",
]


class _SharedPlacementGroupHandle:
    """A placement group owned by someone else: the group schedules into it, never removes
    it (the owner does, after every group sharing it has stopped)."""

    def __init__(self, pg):
        self._pg = pg

    @property
    def placement_group(self):
        return self._pg

    def ready(self):
        return self._pg.ready()

    def wait(self, timeout_seconds=30) -> bool:
        try:
            return self._pg.wait(timeout_seconds)
        except Exception:  # e.g. removed meanwhile: not ready (the start is retried)
            logger.warning("Shared placement group wait failed.", exc_info=True)
            return False

    def shutdown(self) -> None:
        pass


class SharedPlacementWorkerGroup(WorkerGroup):
    """A ``WorkerGroup`` whose worker ``i`` runs in bundle ``i`` of a given placement group
    shared with other groups (colocation), instead of a placement group of its own."""

    @classmethod
    def create_in(cls, placement_group, train_run_context, worker_group_context, callbacks):
        wg = cls(train_run_context, worker_group_context, callbacks)
        wg._shared_pg = placement_group
        wg._start()
        return wg

    def _create_placement_group(self, scaling_config, worker_group_context):
        return _SharedPlacementGroupHandle(self._shared_pg)


class NamedPlacementWorkerGroup(WorkerGroup):
    """A ``WorkerGroup`` whose placement group (Ray Train's default one: a bundle per
    worker; TPU slices are refused on the driver) is named ``name``, so that its owner can
    find and remove it by name."""

    @classmethod
    def create_named(cls, name: str, train_run_context, worker_group_context, callbacks):
        wg = cls(train_run_context, worker_group_context, callbacks)
        wg._pg_name = name
        wg._start()
        return wg

    def _create_placement_group(self, scaling_config, worker_group_context):
        pg = placement_group(
            bundles=[worker_group_context.resources_per_worker] * worker_group_context.num_workers,
            strategy=worker_group_context.placement_strategy,
            bundle_label_selector=worker_group_context.label_selector,
            name=self._pg_name,
        )
        return DefaultPlacementGroupHandle(pg)


class ControllerBase(TrainController):
    """Ray Train's ``TrainController`` with the private hooks and state ray_disagg's
    coordinator uses under public names: it overrides :meth:`start_worker_group` and
    :meth:`after_poll`, and reads the rest."""

    def _start_worker_group(self, num_workers: int, resources_per_worker: dict) -> None:
        self.start_worker_group()

    async def _poll_workers(self):
        return self.after_poll(await super()._poll_workers())

    def start_worker_group(self) -> None:
        """Start the run attempt's worker group and set it with :meth:`set_worker_group`."""
        raise NotImplementedError

    def after_poll(self, status):
        """The poll status Ray Train's state machine sees (default: ``status``)."""
        return status

    def set_worker_group(self, worker_group) -> None:
        self._worker_group = worker_group

    def run_attempt_id(self) -> str:
        return self._get_run_attempt_id()

    @property
    def train_run_context(self) -> TrainRunContext:
        return self._train_run_context

    @property
    def worker_group_callbacks(self) -> list:
        """The callbacks Ray Train hands every worker group it starts."""
        return self._worker_group_callbacks_to_propagate

    @property
    def health_check_interval_s(self) -> float:
        return self._health_check_interval_s

    @property
    def failure_policy(self):
        return self._failure_policy

    @property
    def latest_checkpoint_result(self):
        """The latest registered checkpoint's training result (``.checkpoint``,
        ``.metrics``), or ``None``."""
        return self._checkpoint_manager.latest_checkpoint_result


class TrainerBase(DataParallelTrainer):
    """Ray Train's ``DataParallelTrainer`` with its private hooks under public names:
    :meth:`default_callbacks` and :meth:`run_controller` are overridden by subclasses."""

    def _create_default_callbacks(self):
        return self.default_callbacks(super()._create_default_callbacks())

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        return self.run_controller(**controller_init_kwargs)

    def default_callbacks(self, callbacks: list) -> list:
        """The run's callbacks from Ray Train's defaults (default: as they are)."""
        return callbacks

    def run_controller(self, **controller_init_kwargs):
        """Start the controller with ``controller_init_kwargs`` and return its ``Result``
        (default: Ray Train's)."""
        return super()._initialize_and_run_controller(**controller_init_kwargs)
