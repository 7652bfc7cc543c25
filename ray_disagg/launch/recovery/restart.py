"""Restarting one group alone, on the coordinator's side: :class:`GroupRecovery` keeps
what it needs across the run attempt (the relaunch data, the channel's generation, the
restart and standby take-over counts, the standby pool) and runs the restart through the
worker groups' facade (``ModuleWorkerGroups``: each step below is one of its methods).

A worker of an encoder group dies; instead of tearing every group down:

1. the failed group is stopped (its other workers too: each of its ranks may be
   mid-step) and the survivors' transfers with it are interrupted (gloo's fail by
   themselves as the connections close; shared-memory waits and NCCL pair communicators
   are told to give up); the survivors leave the step together and park
   (:mod:`ray_disagg.worker.recovery`), learning the checkpoint to reload;
2. every survivor parks (their reports are consumed meanwhile: a report blocks its
   worker until polled); reports not yet consolidated are forgotten;
3. a new group of the same shape starts (Ray Train's callbacks hand it the latest
   checkpoint, as on a full restart), or the group's standby takes over
   (:mod:`ray_disagg.launch.recovery.standby`, already started; the next one starts once a later
   checkpoint is registered);
4. the side channel is rebuilt (a new gloo group over every worker; the survivors' own
   process groups and models stay).

Every group then continues from the checkpoint's step, so the result equals an
uninterrupted run. Any failure here falls back to the full restart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ray_disagg.launch.recovery.decisions import RestartGroup
from ray_disagg.launch.recovery.standby import Standby
from ray_disagg.launch.recovery.survivors import Relaunch

logger = logging.getLogger(__name__)

__all__ = ["GroupRecovery"]


@dataclass
class GroupRecovery:
    """What restarting one group needs, for one run attempt (see the module docstring)."""

    relaunch: Relaunch
    generation: int = 0
    """Channel rebuilds (group restarts) in this attempt."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Per group: restarts after a failure (``<group>_restarts``)."""
    takeovers: dict[str, int] = field(default_factory=dict)
    """Per group with a standby: restarts its standby took (``<group>_standby_takeovers``)."""
    standby: dict[str, Any] = field(default_factory=dict)
    """The standby pool: per group with one, its :class:`Standby`."""
    standby_after: dict[str, str] = field(default_factory=dict)
    """Per group whose standby took over: the checkpoint it took over at."""

    def __post_init__(self):
        for name in self.relaunch.launches:
            self.restarts.setdefault(name, 0)

    def start_standbys(self, unsafe: list[str]) -> None:
        """Start the standby of each group whose launch has one, in the background; none
        when callbacks (``unsafe``) are not known to be thread-safe."""
        names = [n for n, launch in self.relaunch.launches.items() if launch.standby_fn_ref]
        if names and unsafe:
            logger.warning("No standby for %s: callbacks %s may not be called from two "
                           "threads.", names, unsafe)  # fmt: skip
            return
        for name in names:
            self.standby[name], self.takeovers[name] = Standby(name), 0
            self.standby[name].start(self.relaunch)

    def replenish(self, latest) -> None:
        """Start the next standby of each group whose standby took over, once ``latest``
        (the latest registered checkpoint result) is a later checkpoint than the one it
        took over at: its start never competes with the recovery."""
        for name, path in list(self.standby_after.items()):
            if latest is not None and latest.checkpoint.path != path:
                del self.standby_after[name]
                self.standby[name].start(self.relaunch)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop every standby (one still starting: waited for up to ``wait_s``)."""
        for s in self.standby.values():
            s.close(wait_s=wait_s)

    def restart(self, groups, decision: RestartGroup) -> dict[str, float]:
        """Replace ``decision.name`` of ``groups`` (the worker groups' facade) and rejoin
        every group at ``decision.checkpoint``; returns the seconds each phase took."""
        failed, checkpoint, timeout_s = (
            decision.name,
            decision.checkpoint,
            self.relaunch.side_timeout_s,
        )
        laps = _Laps()
        groups.stop_group(failed)  # a full restart after this skips it
        groups.interrupt_survivors(failed, self.generation + 1, checkpoint, timeout_s)
        laps.lap("stop")
        groups.park_survivors(failed, timeout_s)
        laps.lap("park")
        launch = decision.launch() if callable(decision.launch) else decision.launch
        if launch is not None:
            self.relaunch = dataclasses.replace(
                self.relaunch, launches=launch.groups, transfers=launch.transfers
            )
        standby = self.standby.get(failed)
        wg = standby.take_over(checkpoint, timeout_s) if standby else None
        took_over = wg is not None
        if wg is None:  # colocated: into the freed bundles of the shared placement group
            wg = groups.start_group(self.relaunch.launches[failed], self.relaunch)
        groups.install_group(failed, wg)
        laps.lap("standby" if took_over else "start")
        self.restarts[failed] += int(decision.failure)
        if took_over:
            self.takeovers[failed] += 1
        self.generation += 1
        groups.connect_channel(self.relaunch.run_attempt_id, timeout_s, self.relaunch.transfers)
        laps.lap("rejoin")
        if standby is not None:  # the next one, once a later checkpoint shows progress
            self.standby_after[failed] = checkpoint.path  # (its start would slow recovery)
        return laps.took


class _Laps:
    def __init__(self):
        self.took, self._t0 = {}, time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.took[name], self._t0 = now - self._t0, now
