"""Every private attribute of Ray that ray_compat touches (:data:`RAY_PRIVATES`, checked
against the installed Ray by ``tests/unit/test_ray_contract.py``), and the readers of Ray's
private state."""

from __future__ import annotations

import dataclasses
import sys

import ray
from ray.train import ScalingConfig
from ray.train.torch.config import TorchConfig
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.storage import StorageContext
from ray.train.v2._internal.execution.worker_group import WorkerGroup
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

__all__ = [
    "RAY_PRIVATES",
    "Private",
    "checkpoint_path",
    "label_selector_per_worker",
    "persist_checkpoint",
    "reports_pending",
    "resources_per_worker",
    "storage_filesystem",
]


@dataclasses.dataclass(frozen=True)
class Private:
    """One private attribute of Ray that a wrapper here touches: ``owner.name`` exists
    (``instance=False``: a class or module attribute, method or property) or is assigned
    as ``self.name`` in ``owner``'s source (``instance=True``)."""

    owner: object
    name: str
    instance: bool = False


RAY_PRIVATES = (
    Private(ScalingConfig, "_resources_per_worker_not_none"),
    Private(ScalingConfig, "_label_selector_per_worker"),
    Private(TrainController, "_start_worker_group"),
    Private(TrainController, "_poll_workers"),
    Private(TrainController, "_get_run_attempt_id"),
    Private(TrainController, "_train_run_context", instance=True),
    Private(TrainController, "_worker_group", instance=True),
    Private(TrainController, "_worker_group_callbacks_to_propagate", instance=True),
    Private(TrainController, "_health_check_interval_s", instance=True),
    Private(TrainController, "_failure_policy", instance=True),
    Private(TrainController, "_checkpoint_manager", instance=True),
    Private(CheckpointManager, "latest_checkpoint_result"),
    Private(DataParallelTrainer, "_create_default_callbacks"),
    Private(DataParallelTrainer, "_initialize_and_run_controller"),
    Private(WorkerGroup, "_start"),
    Private(WorkerGroup, "_create_placement_group"),
    Private(StorageContext, "storage_filesystem", instance=True),
    Private(StorageContext, "persist_current_checkpoint"),
    Private(StorageContext, "build_checkpoint_path_from_name"),
    Private(sys.modules[TorchConfig.__module__], "_TorchBackend"),
    Private(ray, "_raylet"),
    Private(ray, "_private"),
    Private(ray, "_common"),
)


def resources_per_worker(sc: ScalingConfig) -> dict[str, float]:
    """A group's resources per worker with Ray Train's defaults filled in (``{"CPU": 1}``,
    plus ``{"GPU": 1}`` with ``use_gpu``): a copy."""
    return dict(sc._resources_per_worker_not_none)


def label_selector_per_worker(sc: ScalingConfig, num_workers: int):
    """``ScalingConfig.label_selector`` as one selector per worker (or ``None``)."""
    return sc._label_selector_per_worker(num_workers)


def _storage() -> StorageContext:
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().get_storage()


def storage_filesystem():
    """In a worker: the run's ``pyarrow`` filesystem."""
    return _storage().storage_filesystem


def checkpoint_path(name: str) -> str:
    """In a worker: the path of the run's checkpoint directory ``name`` on its filesystem."""
    return _storage().build_checkpoint_path_from_name(name)


def persist_checkpoint(checkpoint, name: str):
    """In a worker: Ray Train's own upload of ``checkpoint`` into the run's ``name``."""
    return _storage().persist_current_checkpoint(checkpoint, name)


def reports_pending() -> bool:
    """In a Ray Train worker: whether its last ``ray.train.report`` still waits for the
    controller's poll to take it (``False`` outside Ray Train)."""
    from ray.train.v2._internal.execution.context import get_train_context

    try:
        queue = get_train_context().get_result_queue()
    except Exception:  # noqa: BLE001 - no Ray Train context (the local runner)
        return False
    return not queue.empty()


def quiet_train_reports() -> None:
    """In a Ray Train worker: Ray's ``Reporting training result ... TrainingReport(...)``
    line of every report (an INFO record of the logger named by its module's file) is
    dropped; the driver prints each step itself (``ray_disagg.launch.progress``)."""
    import logging

    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def quiet_data_progress() -> None:
    """In a Ray Train worker: Ray Data's progress bars off in this process's current
    ``DataContext``, which the datasets built here copy (a ``ConversationStream``'s
    conversions; a Ray Dataset's split: ``ray_disagg.worker.ingest.make_source``), without
    Ray Data's one-time notice that they are off (keyed by its ``log_once`` name)."""
    from ray.data import DataContext
    from ray.util.debug import log_once

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = ctx.enable_operator_progress_bars = False
    log_once("ray_data_progress_manager_disabled")
