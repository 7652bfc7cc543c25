"""A standby copy of a group that restarts alone (``ModuleGroup(standby=True)``).

Most of a group restart is Ray starting the new workers (a process each, imports, the
train context, the group's process group, the train function) and building the model
(seconds per group, paid while every other group waits). A standby is a second worker
group of the same shape, started in the background once the groups run, whose workers
build the group's model, load its weights and build the optimizer, then wait
(``ray_disagg.worker.standby``). When a worker of the group fails, the coordinator stops
the group as usual and hands the standby the checkpoint to continue from instead of
starting a new group; the standby then rejoins the side channel like a restarted group,
and a new standby starts in the background.

It is best effort: a standby that cannot start (no room for a second copy, a start
timeout) or that died meanwhile only logs why, and the group restarts the usual way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import ray

from ray_disagg.launch.group_start import start_group
from ray_disagg.worker import standby as standby_worker

logger = logging.getLogger(__name__)

__all__ = ["Standby", "standby_groups"]


def standby_groups(groups: dict, placement: str, restartable, cfg) -> frozenset[str]:
    """The groups given ``ModuleGroup(standby=True)``, validated on the driver:
    ``ValueError`` unless each restarts alone, at a fixed size, in separate placement,
    from checkpoints."""
    names = frozenset(n for n, g in groups.items() if g.standby)
    for n in sorted(names):
        reason = None
        if placement != "separate":
            reason = "colocated groups restart into the bundles they share"
        elif n not in restartable:
            reason = f"it cannot restart alone here (groups that can: {sorted(restartable)})"
        elif groups[n].elastic:
            reason = "an elastic group restarts at a size known only after the failure"
        elif cfg.checkpoint_every is None:
            reason = "a restart continues from a checkpoint: set checkpoint_every"
        if reason:
            raise ValueError(
                f"ModuleGroup(standby=True) on the {n!r} group: {reason}. A standby needs a "
                "fixed-size encoder group that restarts alone (one encoder group, map-style "
                "data, restart_failed_group=True, placement='separate') and checkpoint_every."
            )
    return names


class Standby:
    """The standby of group ``name``: started with :meth:`start`, used by
    :meth:`take_over`, stopped by :meth:`close` (with the groups). One start at a time;
    a start that is no longer wanted (closed, or given up on by :meth:`take_over`) stops
    its group as soon as it has started."""

    SETTLE_S = 60.0  # the most take_over waits for a standby still starting

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._group = None  # the started standby WorkerGroup
        self._closed = False
        self._wanted = 0  # the start whose group is kept (a counter: older ones are not)
        self._settled = threading.Event()  # no start in flight
        self._settled.set()

    def start(self, relaunch) -> None:
        """Start a standby in a background thread from ``relaunch`` (the groups'
        ``Relaunch``: the group's launch, its train function swapped for the standby's);
        nothing when one is starting or ready."""
        with self._lock:
            if self._closed or self._group is not None or not self._settled.is_set():
                return
            self._settled.clear()
            self._wanted += 1
            token = self._wanted
        threading.Thread(
            target=self._starting, args=(relaunch, token), name=f"standby-{self.name}", daemon=True
        ).start()

    def _starting(self, relaunch, token: int) -> None:
        try:
            wg = self._start_group(relaunch)
            if wg is None:
                return
            with self._lock:
                if not self._closed and token == self._wanted and self._group is None:
                    self._group = wg
                    logger.info("The %s group's standby is ready.", self.name)
                    return
            _stop(wg)  # closed, or given up on, while it started
        finally:
            self._settled.set()

    def _start_group(self, relaunch):
        launch = relaunch.launches[self.name]
        launch = dataclasses.replace(launch, train_fn_ref=launch.standby_fn_ref)
        try:
            return start_group(
                launch, relaunch.train_run_context, relaunch.run_attempt_id, relaunch.shared, None
            )
        except Exception as e:
            logger.warning(
                "The %s group's standby did not start (%r); a failure in the group restarts "
                "it without one.", self.name, e,
            )  # fmt: skip
            return None

    def take_over(self, checkpoint, timeout_s: float):
        """The standby worker group, now continuing from ``checkpoint`` (its train
        function runs the group's loop), or ``None`` when none is ready and alive. A
        standby still starting is waited for (up to ``SETTLE_S``): it is ahead of a new
        group's start; past that it is given up on."""
        if not self._settled.wait(min(timeout_s, self.SETTLE_S)):
            with self._lock:
                self._wanted += 1  # its group is stopped once started
            logger.warning("The %s group's standby is still starting: not used.", self.name)
            return None
        with self._lock:
            wg, self._group = self._group, None
        if wg is None:
            return None
        try:
            status = wg.poll_status(timeout=timeout_s)
            if status.errors or not all(s.running for s in status.worker_statuses.values()):
                raise RuntimeError(status.get_error_string() or "a worker stopped")
            refs = [
                w.execute_async(standby_worker.take_over, checkpoint, timeout_s)
                for w in wg.get_workers()
            ]
            ray.get(refs, timeout=timeout_s + 5)
        except Exception as e:
            logger.warning("The %s standby cannot take over (%r).", self.name, e)
            _stop(wg)
            return None
        return wg

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the standby; one still starting is stopped as soon as it has started
        (waited for up to ``wait_s``, so that its reservation does not outlive the
        groups)."""
        with self._lock:
            self._closed = True
            wg, self._group = self._group, None
        if wg is not None:
            _stop(wg)
        if wait_s and not self._settled.wait(wait_s):
            logger.warning("The %s group's standby was still starting.", self.name)


def _stop(wg) -> None:
    try:
        wg.shutdown()
    except Exception:
        logger.warning("Stopping a standby worker group failed.", exc_info=True)
