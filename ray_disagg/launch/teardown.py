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
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from ray_disagg.launch import reservations

logger = logging.getLogger(__name__)

__all__ = ["interrupt_aborts", "leave_nothing"]


@contextlib.contextmanager
def interrupt_aborts(controller, before_abort=None, abort_timeout_s: float = 30.0):
    """Ctrl-C aborts the run of ``controller`` and raises ``KeyboardInterrupt`` (in the
    main thread only: Python delivers signals there; elsewhere nothing changes);
    ``before_abort()`` runs first (the driver takes the steps reported so far). While the
    coordinator starts the groups it answers the abort only once they started (up to
    ``abort_timeout_s``; a second Ctrl-C stops waiting)."""
    presses = 0

    def on_sigint(signum, frame):
        nonlocal presses
        presses += 1
        if presses == 1:
            logger.warning("Ctrl-C: aborting the run (press again to stop waiting).")
            if before_abort is not None:
                before_abort()
            # the abort ends the coordinator's actor: its call fails when it is done
            with contextlib.suppress(RayActorError, GetTimeoutError):
                ray.get(controller.abort.remote(), timeout=abort_timeout_s)
        raise KeyboardInterrupt

    with _sigint(on_sigint):
        yield


@contextlib.contextmanager
def _sigint(handler):
    """``handler`` for SIGINT inside the block (main thread only), the previous one after
    (unless it was set outside Python and cannot be put back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def leave_nothing(controller, run_id: str, finished: bool, timeout_s: float = 30.0) -> None:
    """After ``fit()``: unless the run ``finished`` (its coordinator returned a result or a
    failure), kill ``controller`` (``None``: never started) and wait until it is gone, so
    that it reserves nothing more; then remove the run's placement groups still there.
    Ctrl-C meanwhile only says it is cleaning up; an error here is logged, never raised
    (the run's own error is the one ``fit()`` raises)."""

    def wait(signum, frame):
        logger.warning("Removing what the run reserved; a moment.")

    with _sigint(wait):
        try:
            if controller is not None and not finished:
                ray.kill(controller, no_restart=True)
                if not _gone(controller, timeout_s):
                    logger.warning("The run's coordinator still lived %gs after it was "
                                   "killed.", timeout_s)  # fmt: skip
            removed = _release(run_id, timeout_s, settle=not finished)
        except Exception:  # noqa: BLE001 - never hide the run's own error
            logger.warning("Cleaning up after the run failed.", exc_info=True)
            return
    if removed:
        logger.info("Removed the run's placement groups left behind: %s", removed)


def _release(run_id: str, timeout_s: float, settle: bool, quiet_s: float = 0.5) -> list[str]:
    """Remove the run's placement groups; when ``settle`` (a coordinator was killed: its
    last requests may still land), look again ``quiet_s`` later until a look finds none."""
    removed, deadline = reservations.release(run_id), time.monotonic() + timeout_s
    while settle and time.monotonic() < deadline:
        time.sleep(quiet_s)
        more = reservations.release(run_id)
        if not more:
            break
        removed += more
    return removed


def _gone(actor, timeout_s: float) -> bool:
    """Whether ``actor`` died within ``timeout_s`` (a call to it fails for good once it
    has)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ActorDiedError:
            return True
        except (ActorUnavailableError, GetTimeoutError):
            pass  # not reachable for now, or slow: ask again
        time.sleep(0.1)
    return False
