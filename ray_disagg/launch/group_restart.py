"""Restart only the failed group.

A worker of an encoder group dies; the coordinator, instead of tearing every group down:

1. stops the failed group (its other workers too: each of its ranks may be mid-step)
   and interrupts the survivors' transfers with it (gloo's fail by themselves as the
   connections close; shared-memory waits and NCCL pair communicators are told to give
   up); the survivors leave the step together and park (:mod:`ray_disagg.worker.recovery`);
2. waits for every survivor to park, consuming their reports meanwhile (a report blocks
   its worker until polled); reports not yet consolidated are forgotten;
3. starts a new group of the same shape (Ray Train's callbacks hand it the latest
   checkpoint, as on a full restart), or hands that checkpoint to the group's standby
   (:mod:`ray_disagg.launch.standby`), already started (the next standby starts once a
   later checkpoint is registered);
4. rebuilds the side channel (a new gloo group over every worker; the survivors' own
   process groups and models stay). The survivors reload that checkpoint in place
   meanwhile (they learn it in step 1).

Every group then continues from the checkpoint's step, so the result equals an
uninterrupted run. Any failure here (a survivor failing or finishing, a start timing
out) falls back to the full restart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import ray

from ray_disagg.launch.group_start import start_group
from ray_disagg.worker import runtime

logger = logging.getLogger(__name__)

__all__ = ["Relaunch", "restart_group", "restartable_groups"]


def restartable_groups(adapter, streamed: bool, cuda_ipc: bool = False) -> frozenset[str]:
    """The groups a worker failure restarts alone (the others keep their workers and
    continue from the latest checkpoint in place): the encoder group of a model with one
    encoder, on map-style data (not ``streamed``), unless a pair may use the ``cuda_ipc``
    tier (a survivor's stream would wait on the dead process's events: nothing can abort
    that). Otherwise (and for any LLM failure) every group restarts, as Ray Train does."""
    if len(adapter.encoder_parts) != 1 or streamed or cuda_ipc:
        return frozenset()
    return frozenset(adapter.encoder_parts)


@dataclass(frozen=True)
class Relaunch:
    """What restarting one group needs, kept from the attempt's start."""

    launches: dict
    train_run_context: object
    run_attempt_id: str
    shared: list
    janitor: object
    side_timeout_s: float
    transfers: object


def _survivors(groups, failed: str) -> list[str]:
    return [n for n in groups.relaunch.launches if n != failed]


def _survivor_workers(groups, failed: str) -> list:
    return [w for n in _survivors(groups, failed) for w in groups.group_workers(n).get_workers()]


def _park_survivors(groups, failed: str, timeout_s: float) -> None:
    """Wait until every survivor's training thread is parked, polling their statuses
    meanwhile (a report blocks its worker until polled; the polls consume them), then
    once more; raises when one fails or finishes instead. Each check is non-blocking
    (a worker answers one call at a time: a waiting call would hold its polls back)."""
    survivors = _survivors(groups, failed)
    workers = _survivor_workers(groups, failed)
    deadline = time.monotonic() + timeout_s
    while True:
        _poll_survivors(groups, survivors, timeout_s)
        parked = ray.get([w.execute_async(runtime.wait_parked, 0.0) for w in workers])
        if all(parked):
            _poll_survivors(groups, survivors, timeout_s)  # reports queued before parking
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the surviving groups did not park in {timeout_s:g}s")
        time.sleep(0.1)


def _poll_survivors(groups, survivors: list[str], timeout_s: float) -> None:
    for n in survivors:
        status = groups.group_workers(n).poll_status(timeout=timeout_s)
        for r, st in status.worker_statuses.items():
            if st.error is not None:
                raise RuntimeError(f"{n} group rank {r} failed too: {st.error}")
            if not st.running:
                raise RuntimeError(f"{n} group rank {r} finished before the restart")


def _interrupt_survivors(groups, failed: str, checkpoint) -> None:
    """The survivors' transfers with the failed group that wait outside gloo give up, and
    they learn the checkpoint to reload (best effort: without it they time out)."""
    gen = groups.generation + 1
    refs = [
        w.execute_async(runtime.interrupt_transfers, failed, gen, checkpoint)
        for w in _survivor_workers(groups, failed)
    ]
    try:
        ray.get(refs, timeout=groups.relaunch.side_timeout_s)
    except Exception:
        logger.warning("Interrupting the survivors' transfers failed.", exc_info=True)


def restart_group(groups, failed: str, checkpoint, launch=None, failure=True) -> dict:
    """Replace group ``failed`` of ``groups`` (a ``ModuleWorkerGroups``) and rejoin every
    group at ``checkpoint``; returns the seconds each phase took. ``launch``: every
    group's launch at the sizes to continue with (an elastic group's new size), or a
    function giving it once the group stopped; default: the same sizes. ``failure``:
    counted in ``<group>_restarts`` (a resize is not)."""
    took, t0 = {}, time.monotonic()

    def lap(name: str) -> None:
        nonlocal t0
        took[name], t0 = time.monotonic() - t0, time.monotonic()

    try:
        groups.group_workers(failed).abort()
    except Exception:
        logger.warning("Stopping the failed %s group failed.", failed, exc_info=True)
    groups.replace_group(failed, None)  # a full restart after this skips it
    _interrupt_survivors(groups, failed, checkpoint)
    lap("stop")
    _park_survivors(groups, failed, groups.relaunch.side_timeout_s)
    lap("park")
    if callable(launch):
        launch = launch()
    if launch is not None:
        groups.relaunch = dataclasses.replace(
            groups.relaunch, launches=launch.groups, transfers=launch.transfers
        )
    r = groups.relaunch
    standby = groups.standby.get(failed)
    wg = standby.take_over(checkpoint, r.side_timeout_s) if standby else None
    took_over = wg is not None
    if wg is None:  # colocated: into the freed bundles of the shared placement group
        wg = start_group(
            r.launches[failed], r.train_run_context, r.run_attempt_id, r.shared,
            groups.shared_placement_group, r.janitor,
        )  # fmt: skip
    groups.replace_group(failed, wg)
    groups.reset_reports()  # for the union's new size
    if groups.shared_placement_group is not None:
        groups.check_pairing()
    lap("standby" if took_over else "start")
    groups.restarts[failed] += int(failure)
    if took_over:
        groups.takeovers[failed] += 1
    groups.generation += 1
    groups.connect_channel(r.run_attempt_id, r.side_timeout_s, r.transfers)
    lap("rejoin")
    if standby is not None:  # the next one, once a later checkpoint shows progress
        groups.standby_after[failed] = checkpoint.path  # (its start would slow recovery)
    return took
