"""Fault drills: kill a worker (or the coordinator) once at a given step, to exercise
``FailureConfig`` restarts and the cleanup paths.

A drill is armed by the environment variable ``RAY_DISAGG_FAULT_DRILL`` holding JSON
``{"group", "step", "marker"[, "rank", "kill", "micro_batch", "trace"]}``; the driver copies it
from its own environment into every worker's (``DisaggregatedTrainer``), and the loops
reach :func:`maybe_inject_failure` only through ``ray_disagg.worker.faults_hook.drill``.

Example:
    >>> with fault_drill(group="text", step=2, marker="/tmp/killed"):  # doctest: +SKIP
    ...     trainer.fit()  # text rank 0 dies once at the start of step 2
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator

from ray_disagg.worker.drill_env import FAULT_DRILL_ENV

__all__ = ["FAULT_DRILL_ENV", "drill_json", "fault_drill", "maybe_inject_failure", "parse"]

_KEYS = {"group", "step", "marker", "rank", "kill", "micro_batch", "trace"}
_REQUIRED = ("group", "step", "marker")
_KILLS = (None, "worker", "coordinator")


def parse(value: str | dict) -> dict:
    """The drill as a dict, validated (``ValueError`` naming what is wrong)."""
    spec = json.loads(value) if isinstance(value, str) else dict(value)
    if not isinstance(spec, dict):
        raise ValueError(f"{FAULT_DRILL_ENV}={value!r}: must be a JSON object.")
    unknown = sorted(set(spec) - _KEYS)
    missing = [k for k in _REQUIRED if k not in spec]
    if unknown or missing:
        raise ValueError(
            f"{FAULT_DRILL_ENV}={value!r}: unknown keys {unknown}, missing keys {missing}; "
            f"the keys are {sorted(_KEYS)}."
        )
    for key in ("step", "rank", "micro_batch"):
        v = spec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{FAULT_DRILL_ENV}: {key}={v!r} must be an int >= 0.")
    if not isinstance(spec["group"], str) or not isinstance(spec["marker"], str):
        raise ValueError(f"{FAULT_DRILL_ENV}: group and marker must be strings.")
    if spec.get("kill") not in _KILLS:
        raise ValueError(f"{FAULT_DRILL_ENV}: kill={spec['kill']!r} must be one of {_KILLS}.")
    if not isinstance(spec.get("trace", False), bool):
        raise ValueError(f"{FAULT_DRILL_ENV}: trace={spec['trace']!r} must be a bool.")
    if spec.get("trace") and (spec.get("kill") or spec.get("micro_batch") is not None):
        raise ValueError(f"{FAULT_DRILL_ENV}: a trace kills nothing and traces whole steps.")
    return spec


def drill_json(
    *,
    group: str,
    step: int,
    marker: str | os.PathLike,
    rank: int = 0,
    kill: str | None = None,
    micro_batch: int | None = None,
    trace: bool = False,
) -> str:
    """The value of ``RAY_DISAGG_FAULT_DRILL`` for one drill: worker ``rank`` of ``group``
    dies at the start of ``step`` (0-based; of its microbatch ``micro_batch`` when given),
    once: ``marker`` (a file path) records that it happened. ``kill="coordinator"``: that
    worker kills the run's coordinator instead. ``trace=True``: nothing dies; the
    ``ray_disagg`` functions the worker enters during ``step`` go to ``marker``
    (:func:`_trace_step`)."""
    spec = {"group": group, "step": step, "marker": os.fspath(marker), "rank": rank}
    if kill is not None:
        spec["kill"] = kill
    if trace:
        spec["trace"] = True
    if micro_batch is not None:
        spec["micro_batch"] = micro_batch
    parse(spec)
    return json.dumps(spec)


@contextlib.contextmanager
def fault_drill(**drill) -> Iterator[str]:
    """Arm a drill (the arguments of :func:`drill_json`) in this process's environment
    for the ``with`` block: a ``fit()`` inside it hands it to its workers."""
    old = os.environ.get(FAULT_DRILL_ENV)
    os.environ[FAULT_DRILL_ENV] = value = drill_json(**drill)
    try:
        yield value
    finally:
        if old is None:
            os.environ.pop(FAULT_DRILL_ENV, None)
        else:
            os.environ[FAULT_DRILL_ENV] = old


@functools.lru_cache(maxsize=4)
def _armed(value: str) -> dict:
    return parse(value)


def maybe_inject_failure(
    module: str, group_rank: int, step: int, micro_batch: int | None = None
) -> None:
    """Run the armed drill if it is this worker's: ``module``'s worker ``group_rank`` at
    the start of ``step`` (or of its microbatch ``micro_batch``) exits the process (or, with
    ``"kill": "coordinator"``, kills the coordinator), once. A no-op when no drill is armed."""
    value = os.environ.get(FAULT_DRILL_ENV)
    if not value:
        return
    drill = _armed(value)
    if drill.get("trace") and drill["group"] == module and micro_batch is None:
        _trace_step(drill, group_rank, step)
        return
    if drill.get("trace") or drill["group"] != module or drill["step"] != step:
        return
    if drill.get("micro_batch") != micro_batch or group_rank != drill.get("rank", 0):
        return
    if os.path.exists(drill["marker"]):
        return
    with open(drill["marker"], "w") as f:
        f.write(f"{module} rank {group_rank} killed at step {step}\n")
    if drill.get("kill") == "coordinator":  # the controller actor, not this worker
        from ray_disagg.launch.ray_compat import kill_controller

        kill_controller()
        time.sleep(600)  # dies with its owner, the coordinator
    _wait_reports_taken()
    os._exit(1)


def _wait_reports_taken(timeout_s: float = 10.0) -> None:
    """The worker's last report reaches the controller before it dies (a report not yet
    polled dies with it, and the checkpoint it completes is never registered: the drill
    would test a race instead of a failure after that checkpoint)."""
    from ray_disagg.launch.ray_compat import reports_pending
    from ray_disagg.worker.session import get_session

    deadline = time.monotonic() + timeout_s
    get_session().wait_reports(timeout_s)  # an asynchronous upload queues it when done
    while reports_pending() and time.monotonic() < deadline:
        time.sleep(0.05)


_TRACE: dict = {}  # the step being traced: its number, its output file, its calls


def _trace_step(drill: dict, group_rank: int, step: int) -> None:
    """A tracing drill: from the start of ``step`` to the start of the next, the
    ``ray_disagg`` functions this worker's training thread enters (``sys.setprofile``),
    written to ``marker`` as JSON ``{"files": [...], "functions": [[file, qualname],
    ...]}`` (files relative to the package; comprehensions, lambdas and this testing
    package not counted)."""
    if _TRACE and step != _TRACE["step"]:
        sys.setprofile(None)
        calls = sorted(_TRACE["calls"])
        with open(_TRACE["marker"], "w") as f:
            json.dump({"files": sorted({c[0] for c in calls}), "functions": calls}, f)
        _TRACE.clear()
        return
    if _TRACE or drill["step"] != step or group_rank != drill.get("rank", 0):
        return
    own = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(own)  # the ray_disagg package
    calls: set = set()
    _TRACE.update(step=step, marker=drill["marker"], calls=calls)

    def profile(frame, event, _arg):
        code = frame.f_code
        path = code.co_filename
        ours = path.startswith(root) and not path.startswith(own)
        if event == "call" and ours and not code.co_name.startswith("<"):
            calls.add((os.path.relpath(path, root), code.co_qualname))

    sys.setprofile(profile)
