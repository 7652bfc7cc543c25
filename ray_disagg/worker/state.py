"""What changes while a worker trains, owned by its loop: :class:`WorkerState`.

The step clock, the cross-group sends not yet known delivered, the failure flag of the
step and the counters change only through this object's methods, so every change of a
worker's state can be found here (a test forbids writing these attributes elsewhere:
``tests/unit/test_worker_state.py``).
"""

from __future__ import annotations

from ray_disagg.worker.clock import StepClock

__all__ = ["WorkerState"]


class WorkerState:
    """A worker's state across steps: its :class:`StepClock`, the posted sends, whether
    a transfer of this step failed (``peer_failed``, :mod:`ray_disagg.worker.recovery`),
    the backward passes of this step and the steps not applied."""

    __slots__ = ("backward_passes", "clock", "peer_failed", "pending", "skipped")

    def __init__(self) -> None:
        self.clock = StepClock()
        self.pending: list = []
        self.peer_failed = False
        self.backward_passes = 0
        self.skipped = 0

    def post(self, handle) -> None:
        """Keep a posted send's handle until :meth:`wait_pending`."""
        self.pending.append(handle)

    def wait_pending(self, _mb=None) -> None:
        """Wait for the posted sends (before their tensors may change)."""
        for handle in self.pending:
            handle.wait()
        self.pending = []

    def drop_pending(self) -> None:
        """Forget the posted sends (their channel was closed)."""
        self.pending = []

    def mark_peer_failed(self) -> None:
        """A cross-group transfer of this step failed."""
        self.peer_failed = True

    def count_backward(self) -> None:
        self.backward_passes += 1

    def take_backward_passes(self) -> int:
        """This step's backward passes; the next step counts from 0."""
        n, self.backward_passes = self.backward_passes, 0
        return n

    def count_skipped(self) -> None:
        """A step was not applied (no label token, or non-finite with skipping)."""
        self.skipped += 1

    def restart_clock(self) -> None:
        """A new clock: what ran before (a reference pass, a failed step) is not the next
        step's time."""
        self.clock = StepClock()

    def rejoined(self) -> None:
        """After a group restart: no failure, no backward pass, a new clock."""
        self.peer_failed, self.backward_passes = False, 0
        self.restart_clock()
