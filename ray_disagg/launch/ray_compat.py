"""Every Ray private / developer API that ray_disagg touches, in one place.

``tests/test_ray_contract.py`` checks each name and the signatures we rely on, so that a
Ray upgrade breaks that one test rather than the package. Tested with Ray 2.60.
"""

from __future__ import annotations

import copy
import logging

import ray
from ray.train.torch.config import TorchConfig, _TorchBackend
from ray.train.v2._internal.callbacks import (
    AcceleratorSetupCallback,
    BackendSetupCallback,
    DatasetsCallback,
    WorkingDirectorySetupCallback,
)
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.callbacks.user_callback import UserCallbackHandler
from ray.train.v2._internal.constants import (
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    get_env_vars_to_propagate,
    is_v2_enabled,
)
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
from ray.train.v2._internal.execution.context import TrainRunContext
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.failure_handling import create_failure_policy
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2._internal.execution.scaling_policy import create_scaling_policy
from ray.train.v2._internal.execution.worker_group import (
    WorkerGroup,
    WorkerGroupContext,
    WorkerGroupPollStatus,
    WorkerStatus,
)
from ray.train.v2._internal.util import ObjectRefWrapper, construct_train_func
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.api.exceptions import WorkerGroupError

TESTED_RAY_VERSIONS = ("2.60",)
DEFAULT_POLL_INTERVAL_S = 0.2

logger = logging.getLogger(__name__)

__all__ = [
    "AcceleratorSetupCallback",
    "BackendSetupCallback",
    "DataParallelTrainer",
    "DatasetsCallback",
    "FailureDecision",
    "ObjectRefWrapper",
    "PlacementGroupCleanerCallback",
    "PreemptionCallback",
    "ReportCallbackHandler",
    "TorchConfig",
    "TrainController",
    "TrainRunContext",
    "UserCallbackHandler",
    "WorkerGroup",
    "WorkerGroupCallback",
    "WorkerGroupContext",
    "WorkerGroupError",
    "WorkerGroupPollStatus",
    "WorkerGroupStartupTimeoutError",
    "WorkerStatus",
    "WorkingDirectorySetupCallback",
    "available_resources_per_node",
    "_TorchBackend",
    "construct_train_func",
    "create_failure_policy",
    "create_scaling_policy",
    "get_env_vars_to_propagate",
    "is_v2_enabled",
    "run_controller_actor",
    "group_train_run_context",
    "kill_controller",
    "current_placement",
    "wait_reports_queued",
    "SharedPlacementWorkerGroup",
    "with_worker_env_vars",
]


def group_train_run_context(base: TrainRunContext, scaling_config, backend_config):
    """A copy of the run context for one module group (same run id, own scaling/backend)."""
    ctx = TrainRunContext(
        run_config=base.run_config,
        train_loop_config=base.train_loop_config,
        scaling_config=scaling_config,
        backend_config=backend_config,
        dataset_config=base.dataset_config,
    )
    object.__setattr__(ctx, "run_id", base.run_id)
    return ctx


def with_worker_env_vars(base: TrainRunContext, env_vars: dict[str, str]) -> TrainRunContext:
    """A copy of the run context whose workers also get ``env_vars`` (through
    ``RunConfig.worker_runtime_env``; a variable the user set there wins). The caller's
    context and ``RunConfig`` are left as they are."""
    if not env_vars:
        return base
    run_config = copy.copy(base.run_config)
    runtime_env = dict(run_config.worker_runtime_env or {})
    runtime_env["env_vars"] = {**env_vars, **dict(runtime_env.get("env_vars") or {})}
    run_config.worker_runtime_env = runtime_env
    ctx = copy.copy(base)
    object.__setattr__(ctx, "run_config", run_config)
    return ctx


def run_controller_actor(controller_cls, **controller_kwargs):
    """Start ``controller_cls`` the way Ray Train V2 starts its ``TrainController``.

    The actor takes no CPU, is pinned to the driver's node and receives the env vars that
    Ray Train propagates; returns the ``Result``.
    """
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE

    env_vars = get_env_vars_to_propagate()
    env_vars.setdefault(
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
    )
    # A worker blocks in ray.train.report until the controller has polled its previous
    # report; Ray's 2 s default poll would cap training at one reported step per 2 s.
    env_vars.setdefault(HEALTH_CHECK_INTERVAL_S_ENV_VAR, str(DEFAULT_POLL_INTERVAL_S))
    actor_cls = ray.remote(
        num_cpus=0,
        label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
        runtime_env={"env_vars": env_vars},
    )(controller_cls)
    controller = actor_cls.remote(**controller_kwargs)
    return controller


def kill_controller() -> None:
    """From a worker: kill the run's controller actor (a fault drill)."""
    from ray.train.v2._internal.execution.context import get_train_context

    ray.kill(get_train_context().controller_actor, no_restart=True)


def current_placement() -> tuple[str | None, int | None]:
    """From a worker: ``(placement group id, bundle index)`` it was scheduled in, read from
    the resources the raylet assigned (``CPU_group_<bundle>_<pg id>``)."""
    import re

    ids = ray._private.worker.global_worker.core_worker.resource_ids()
    for key in ids:
        m = re.fullmatch(r".+_group_(\d+)_([0-9a-f]+)", key)
        if m:
            return m[2], int(m[1])
    return ray.get_runtime_context().get_placement_group_id(), None


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


def available_resources_per_node() -> list[dict]:
    """Each alive node's free resources, as the GCS last heard them."""
    from ray._private import state

    return list(state.available_resources_per_node().values())


def wait_reports_queued(timeout_s: float) -> bool:
    """In a worker: until every ``ray.train.report`` call of this worker has put its
    result on the queue the controller polls (an asynchronous upload puts it when done,
    in call order)."""
    from ray.train.v2._internal.execution.context import get_train_context

    ctx = get_train_context()
    with ctx.report_order_condition:
        return ctx.report_order_condition.wait_for(
            lambda: ctx.current_report_index == ctx.report_call_index, timeout_s
        )
