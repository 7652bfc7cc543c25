"""The driver's end of a run, however ``fit()`` ends: nothing of the run is left on the
cluster for the next ``fit()`` in the same Ray session to wait for.

- :func:`interrupt_aborts`: while the run goes, Ctrl-C (SIGINT) aborts it (the coordinator
  stops every group) and ``fit()`` raises ``KeyboardInterrupt``; a second Ctrl-C stops
  waiting for the abort. The handler that was there before comes back afterwards.
- :func:`leave_nothing`: a coordinator that did not finish (dead, interrupted, or the
  driver failed) is killed and waited for, then every placement group of the run is
  removed (``ray_disagg.launch.reservations``). The workers are the coordinator's actors:
  they end with it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ray_disagg.launch import reservations

logger = logging.getLogger(__name__)

__all__ = ["interrupt_aborts", "leave_nothing"]


@contextlib.contextmanager
def interrupt_aborts(controller, abort_timeout_s: float = 30.0):
    """Ctrl-C aborts the run of ``controller`` and raises ``KeyboardInterrupt`` (in the
    main thread only: Python delivers signals there; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    presses = 0

    def on_sigint(signum, frame):
        nonlocal presses
        presses += 1
        if presses == 1:
            logger.warning("Ctrl-C: aborting the run (press again to stop waiting).")
            # the abort ends the coordinator's actor: its call fails when it is done
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(controller.abort.remote(), timeout=abort_timeout_s)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def leave_nothing(controller, run_id: str, finished: bool, timeout_s: float = 30.0) -> None:
    """After ``fit()``: unless the run ``finished`` (its coordinator returned a result or a
    failure), kill ``controller`` (``None``: never started) and wait until it is gone, so
    that it reserves nothing more; then remove the run's placement groups still there."""
    if controller is not None and not finished:
        ray.kill(controller, no_restart=True)
        if not _gone(controller, timeout_s):
            logger.warning("The run's coordinator still lived %gs after it was killed.", timeout_s)
    removed = reservations.release(run_id)
    if removed:
        logger.info("Removed the run's placement groups left behind: %s", removed)


def _gone(actor, timeout_s: float) -> bool:
    """Whether ``actor`` died within ``timeout_s`` (a call to it fails once it has)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except RayActorError:
            return True
        except GetTimeoutError:
            return False
        time.sleep(0.1)
    return False
