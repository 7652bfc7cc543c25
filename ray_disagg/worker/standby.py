"""A standby worker: a worker of a group's standby copy, ready to take a failed group's
place (``ray_disagg.launch.recovery.standby``).

Ray Train starts it like any worker (process, train context, the group's process group
and device mesh from the backend) and it runs the group's own loop, which builds the
model (its process groups included), loads its weights and builds the optimizer, then
waits in :func:`wait_take_over`. When the coordinator hands it the checkpoint to
continue from (:func:`take_over`, which returns only once the worker waits there, so
that the channel the coordinator builds next never overlaps the loop's own process-group
setup), the loop joins the channel and restores that checkpoint as after a restart.
"""

from __future__ import annotations

import threading

from ray_disagg.worker.session import get_session

__all__ = ["StandbyLoop", "is_standby", "take_over", "wait_take_over"]

_standby = False  # this process runs a StandbyLoop
_ready = threading.Event()  # its model is built: it waits to take over
_taken = threading.Event()


class StandbyLoop:
    """The train function of a standby worker: ``loop()``, which waits in
    :func:`wait_take_over` once its model is ready."""

    def __init__(self, loop):
        self.loop = loop

    def __call__(self):  # as the groups' loops: they take no config
        global _standby
        _standby = True
        return self.loop()


def is_standby() -> bool:
    """This worker is a standby that has not taken a group's place yet."""
    return _standby and not _taken.is_set()


def wait_take_over() -> None:
    """(The training thread.) Until this worker takes a group's place: at once for a
    worker that is no standby."""
    if _standby:
        _ready.set()
        _taken.wait()


def take_over(checkpoint, timeout_s: float) -> None:
    """(The coordinator, any thread.) This standby worker takes its group's place and
    continues from ``checkpoint``, once its model is built (up to ``timeout_s``)."""
    if not _ready.wait(timeout_s):
        raise TimeoutError(f"the standby worker's model was not built within {timeout_s:g}s")
    get_session().taken_over_at = checkpoint
    _taken.set()
