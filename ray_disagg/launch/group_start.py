"""Start one module's Ray Train ``WorkerGroup``: its own placement group (or bundles of a
shared one, colocated), resources, backend and callbacks; registered with the driver's
placement-group janitor. Used by the first start of a run attempt, a group restart and a
standby."""

from __future__ import annotations

import logging

import ray

from ray_disagg.launch.launches import GroupLaunch
from ray_disagg.launch.ray_compat import (
    AcceleratorSetupCallback,
    BackendSetupCallback,
    SharedPlacementWorkerGroup,
    WorkerGroup,
    WorkerGroupContext,
    group_train_run_context,
    label_selector_per_worker,
    resources_per_worker,
)

logger = logging.getLogger(__name__)

__all__ = ["shutdown_all", "start_group"]


def start_group(
    launch: GroupLaunch, base_ctx, run_attempt_id: str, shared: list, shared_pg, janitor
) -> WorkerGroup:
    """Start ``launch``'s group with the run's ``shared`` callbacks (in bundles of
    ``shared_pg`` when colocated), its own placement group registered with ``janitor``
    (to be removed should the coordinator die); stopped again when that fails."""
    wg = _create(launch, base_ctx, run_attempt_id, shared, shared_pg)
    if janitor is not None and shared_pg is None:
        try:
            pg = wg.get_worker_group_state().placement_group_handle.placement_group
            ray.get(janitor.register.remote(pg))
        except BaseException:
            shutdown_all([wg])
            raise
    return wg


def _create(launch: GroupLaunch, base_ctx, run_attempt_id, shared, shared_pg) -> WorkerGroup:
    sc = launch.scaling_config
    ctx = group_train_run_context(base_ctx, sc, launch.backend_config)
    wg_ctx = WorkerGroupContext(
        run_attempt_id=run_attempt_id,
        train_fn_ref=launch.train_fn_ref,
        num_workers=sc.num_workers,
        resources_per_worker=resources_per_worker(sc),
        placement_strategy=sc.placement_strategy,
        label_selector=label_selector_per_worker(sc, sc.num_workers),
    )
    own = [
        AcceleratorSetupCallback(launch.backend_config, sc),
        BackendSetupCallback(launch.backend_config),
    ]
    logger.info("Starting %s group: %d workers", launch.name, sc.num_workers)
    if shared_pg is not None:
        return SharedPlacementWorkerGroup.create_in(shared_pg, ctx, wg_ctx, own + shared)
    return WorkerGroup.create(
        train_run_context=ctx, worker_group_context=wg_ctx, callbacks=own + shared
    )


def shutdown_all(groups) -> None:
    """Stop each of ``groups`` (``WorkerGroup``s), logging a failure and going on."""
    for wg in groups:
        try:
            wg.shutdown()
        except Exception:
            logger.warning("Shutting down a partially started group failed.", exc_info=True)
