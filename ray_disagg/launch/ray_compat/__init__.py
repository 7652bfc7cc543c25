"""Every Ray private / developer API that ray_disagg touches, in one package.

Ray's private names (``_``-prefixed attributes and methods, ``ray._private``, the
``_internal`` modules) are used here only, each behind a wrapper with a public name:
the subclasses of Ray's controller, trainer and worker group
(:mod:`~ray_disagg.launch.ray_compat.subclasses`) turn the private hooks we override
into public ones; :mod:`~ray_disagg.launch.ray_compat.privates` reads private state and
lists in ``RAY_PRIVATES`` every private attribute touched here. ``tests/unit/test_ray_contract.py``
asserts that each exists in the installed Ray and that no module outside this package
names one, so that a Ray upgrade breaks that one test rather than the package. Tested
with Ray 2.60.
"""

from __future__ import annotations

import copy
import logging

import ray
from ray.train.torch.config import TorchConfig
from ray.train.torch.config import _TorchBackend as TorchBackend
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
from ray.train.v2._internal.execution.callback import ReportCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
from ray.train.v2._internal.execution.context import TrainRunContext
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.failure_handling import create_failure_policy
from ray.train.v2._internal.execution.failure_handling.failure_policy import (
    FailureDecision,
    FailurePolicy,
)
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

from ray_disagg.launch.ray_compat.privates import (
    RAY_PRIVATES,
    checkpoint_path,
    label_selector_per_worker,
    persist_checkpoint,
    quiet_data_progress,
    quiet_train_reports,
    reports_pending,
    resources_per_worker,
    storage_filesystem,
)
from ray_disagg.launch.ray_compat.subclasses import (
    ControllerBase,
    NamedPlacementWorkerGroup,
    SharedPlacementWorkerGroup,
    TrainerBase,
)

TESTED_RAY_VERSIONS = ("2.60",)
DEFAULT_POLL_INTERVAL_S = 0.2

logger = logging.getLogger(__name__)

__all__ = [
    "AcceleratorSetupCallback",
    "BackendSetupCallback",
    "ControllerBase",
    "RAY_PRIVATES",
    "TorchBackend",
    "TrainerBase",
    "DataParallelTrainer",
    "DatasetsCallback",
    "FailureDecision",
    "FailurePolicy",
    "ObjectRefWrapper",
    "PlacementGroupCleanerCallback",
    "PreemptionCallback",
    "ReportCallbackHandler",
    "TorchConfig",
    "TrainController",
    "TrainRunContext",
    "UserCallbackHandler",
    "ReportCallback",
    "WorkerGroup",
    "WorkerGroupCallback",
    "WorkerGroupContext",
    "WorkerGroupError",
    "WorkerGroupPollStatus",
    "WorkerGroupStartupTimeoutError",
    "WorkerStatus",
    "WorkingDirectorySetupCallback",
    "available_resources_per_node",
    "live_actors",
    "storage_location",
    "checkpoint_path",
    "label_selector_per_worker",
    "persist_checkpoint",
    "resources_per_worker",
    "storage_filesystem",
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
    "NamedPlacementWorkerGroup",
    "SharedPlacementWorkerGroup",
    "with_worker_env_vars",
    "quiet_data_progress",
    "quiet_train_reports",
    "reports_pending",
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


def available_resources_per_node() -> list[dict]:
    """Each alive node's free resources, as the GCS last heard them."""
    from ray._private import state

    return list(state.available_resources_per_node().values())


def storage_location(storage_path, storage_filesystem=None):
    """``(pyarrow filesystem, path)`` of a ``RunConfig``'s storage, as Ray Train resolves
    it (a URI's scheme, a custom filesystem, or a local path)."""
    from ray.train.v2._internal.execution.storage import get_fs_and_path

    return get_fs_and_path(storage_path, storage_filesystem)


def live_actors() -> list[dict]:
    """Every actor of the cluster not dead, as the GCS knows it (no dashboard needed):
    ``{"class_name", "state", "pid", "actor_id"}`` each."""
    from ray._private import state

    return [
        {"class_name": a["ActorClassName"], "state": a["State"], "pid": a["Pid"],
         "actor_id": a["ActorID"]}
        for a in state.actors().values()
        if a["State"] != "DEAD"
    ]  # fmt: skip


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
