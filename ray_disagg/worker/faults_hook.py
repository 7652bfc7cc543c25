"""The workers' only way to the fault drills of ``ray_disagg.testing.faults``.

A drill is armed only by the environment variable ``RAY_DISAGG_FAULT_DRILL`` (set by the
test suite; the driver copies it into every worker's environment), never by a user's
configuration. Unset, :func:`drill` returns at once and the test machinery is not imported.
"""

from __future__ import annotations

import os

from ray_disagg.worker.drill_env import FAULT_DRILL_ENV

__all__ = ["FAULT_DRILL_ENV", "drill"]


def drill(module: str, group_rank: int, step: int, micro_batch: int | None = None) -> None:
    """Called by the loops at the start of each step (and microbatch): runs the armed
    drill, if any, for this worker."""
    if not os.environ.get(FAULT_DRILL_ENV):
        return
    from ray_disagg.testing import faults

    faults.maybe_inject_failure(module, group_rank, step, micro_batch)
