"""Start one module's Ray Train ``WorkerGroup``: its own placement group, named for the run
(``ray_disagg.launch.reservations``), or bundles of a shared one (colocated); resources,
backend and callbacks. Used by the first start of a run attempt, a group restart and a
standby."""

from __future__ import annotations

import logging

from ray_disagg.launch.launches import GroupLaunch
from ray_disagg.launch.ray_compat import (
    AcceleratorSetupCallback,
    BackendSetupCallback,
    NamedPlacementWorkerGroup,
    SharedPlacementWorkerGroup,
    WorkerGroup,
    WorkerGroupContext,
    group_train_run_context,
    label_selector_per_worker,
    resources_per_worker,
)
from ray_disagg.launch.reservations import reservation_name

logger = logging.getLogger(__name__)

__all__ = ["shutdown_all", "start_group"]


def start_group(
    launch: GroupLaunch, base_ctx, run_attempt_id: str, shared: list, shared_pg
) -> WorkerGroup:
    """Start ``launch``'s group with the run's ``shared`` callbacks: in bundles of
    ``shared_pg`` when colocated, else in a placement group of its own named for the run
    (``base_ctx.run_id``), which the driver removes should the coordinator die."""
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
    name = reservation_name(base_ctx.run_id, launch.name)
    return NamedPlacementWorkerGroup.create_named(name, ctx, wg_ctx, own + shared)


def shutdown_all(groups) -> None:
    """Stop each of ``groups`` (``WorkerGroup``s), logging a failure and going on."""
    for wg in groups:
        try:
            wg.shutdown()
        except Exception:
            logger.warning("Shutting down a partially started group failed.", exc_info=True)
