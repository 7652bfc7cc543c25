"""A standby worker: a worker of a group's standby copy, ready to take a failed group's
place (``ray_disagg.launch.standby``).

Ray Train starts it like any worker (process, train context, the group's process group
and device mesh from the backend) and it runs the group's own loop, which builds the
model, loads its weights and builds the optimizer, then waits in
:func:`wait_take_over`. When the coordinator hands it the checkpoint to continue from
(:func:`take_over`), the loop joins the channel and restores that checkpoint as after a
restart.
"""

from __future__ import annotations

import threading

from ray_disagg.worker.session import get_session

__all__ = ["StandbyLoop", "take_over", "wait_take_over"]

_active = threading.Event()
_active.set()  # a worker that is no standby is active from the start


class StandbyLoop:
    """The train function of a standby worker: ``loop()``, which waits in
    :func:`wait_take_over` once its model is ready."""

    def __init__(self, loop):
        self.loop = loop

    def __call__(self):  # as the groups' loops: they take no config
        _active.clear()
        return self.loop()


def wait_take_over() -> None:
    """(The training thread.) Until this worker takes a group's place: at once for a
    worker that is no standby."""
    _active.wait()


def take_over(checkpoint) -> None:
    """(The coordinator, any thread.) This standby worker takes its group's place and
    continues from ``checkpoint``."""
    get_session().taken_over_at = checkpoint
    _active.set()
