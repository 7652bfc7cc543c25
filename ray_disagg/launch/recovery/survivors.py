"""Restarting one group alone, the coordinator's calls to the surviving groups: which
groups may restart alone (:func:`restartable_groups`, also checked on the driver), what
a restart needs from the attempt's start (:class:`Relaunch`), and the Ray calls that stop
the survivors' transfers and park them (used by ``ModuleWorkerGroups``; the sequence is
:meth:`~ray_disagg.launch.recovery.restart.GroupRecovery.restart`; what the surviving
workers run meanwhile: :mod:`ray_disagg.worker.recovery`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray

from ray_disagg.worker import runtime

logger = logging.getLogger(__name__)

__all__ = ["Relaunch", "interrupt", "park", "restartable_groups"]


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
    side_timeout_s: float
    transfers: object


def park(survivors: dict, timeout_s: float) -> None:
    """Wait until every worker of ``survivors`` (group name -> ``WorkerGroup``) has parked
    its training thread, polling their statuses meanwhile (a report blocks its worker
    until polled; the polls consume them), then once more; raises when one fails or
    finishes instead. Each check is non-blocking (a worker answers one call at a time: a
    waiting call would hold its polls back)."""
    workers = [w for wg in survivors.values() for w in wg.get_workers()]
    deadline = time.monotonic() + timeout_s
    while True:
        _poll(survivors, timeout_s)
        parked = ray.get([w.execute_async(runtime.wait_parked, 0.0) for w in workers])
        if all(parked):
            _poll(survivors, timeout_s)  # reports queued before parking
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the surviving groups did not park in {timeout_s:g}s")
        time.sleep(0.1)


def _poll(survivors: dict, timeout_s: float) -> None:
    for n, wg in survivors.items():
        status = wg.poll_status(timeout=timeout_s)
        for r, st in status.worker_statuses.items():
            if st.error is not None:
                raise RuntimeError(f"{n} group rank {r} failed too: {st.error}")
            if not st.running:
                raise RuntimeError(f"{n} group rank {r} finished before the restart")


def interrupt(workers: list, failed: str, generation: int, checkpoint, timeout_s: float) -> None:
    """The survivors' ``workers``' transfers with the ``failed`` group that wait outside
    gloo give up, and they learn the channel's next ``generation`` and the checkpoint to
    reload (best effort: without it they time out)."""
    refs = [w.execute_async(runtime.interrupt_transfers, failed, generation, checkpoint)
            for w in workers]  # fmt: skip
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception:
        logger.warning("Interrupting the survivors' transfers failed.", exc_info=True)
