"""A worker's time in a step: :class:`StepClock` (computing, waiting and, of the waiting,
getting the step's inputs; the wall time between two stats exchanges) and the trace of a
traced step's actions (``<run>/trace/``, :func:`write_trace`)."""

from __future__ import annotations

import contextlib
import time

import torch

from ray_disagg import run_files
from ray_disagg.transport.channel import Channel
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.console import log_line

__all__ = ["StepClock", "write_trace"]


class StepClock:
    """Seconds a worker spends computing and waiting in a step (:meth:`span`); of the
    waiting, those spent getting the step's inputs (:meth:`awaiting_inputs`;
    ``StepStats`` makes the data wait of it); and the wall time between two stats
    exchanges, not counting time spent reporting (``excluded``)."""

    __slots__ = ("compute", "cycles", "excluded", "inputs", "last_exchange", "trace", "wait")

    def __init__(self):
        self.last_exchange = time.perf_counter()
        self.excluded = 0.0
        self.cycles: list[float] = []
        self.compute = self.wait = self.inputs = 0.0
        self.trace: list | None = None  # a traced step's [action, start, end, waiting]

    def begin(self, step: int, trace_steps) -> None:
        """Start ``step`` (from 0): its actions are recorded when it is one of
        ``trace_steps`` (from 1)."""
        self.trace = [] if step + 1 in trace_steps else None

    @contextlib.contextmanager
    def span(self, waiting: bool, action=None):
        t0, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if waiting:
                self.wait += dt
            else:
                self.compute += dt
            if self.trace is not None and action is not None:
                self.trace.append([str(action), wall, wall + dt, waiting])

    @contextlib.contextmanager
    def awaiting_inputs(self):
        """Time (within a :meth:`span`, counted there too) spent getting the step's
        inputs: the reading group's pull from its data, another group's receipt of them."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.inputs += time.perf_counter() - t0

    @contextlib.contextmanager
    def paused(self):
        """Spans inside (a validation pass) count in no step's compute, wait or input
        time (their wall time is :meth:`exclude`'s)."""
        saved = (self.compute, self.wait, self.inputs)
        try:
            yield
        finally:
            self.compute, self.wait, self.inputs = saved

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (reporting, validation) out of this step's time."""
        self.excluded += seconds

    def take_trace(self) -> list | None:
        """The traced step's actions (``None``: the step is not traced); recording stops."""
        trace, self.trace = self.trace, None
        return trace

    def take(self) -> tuple[float, float, float]:
        """``(compute, wait, inputs)`` seconds of this step so far (``inputs``: of the
        spans' seconds, those spent getting the step's inputs); starts the next step at 0."""
        out = (self.compute, self.wait, self.inputs)
        self.compute = self.wait = self.inputs = 0.0
        return out

    def exchange(self, channel: Channel, stats: torch.Tensor, layout, is_timer: bool):
        now = time.perf_counter()
        cycle = layout.index["cycle"]
        if is_timer:
            stats[cycle] = now - self.last_exchange - self.excluded
        self.last_exchange, self.excluded = now, 0.0
        stats = channel.all_reduce_sum(stats)
        self.cycles.append(float(stats[cycle]))
        return stats

    @property
    def mean_step_time(self) -> float:
        """Mean step time without the first (warm-up) step."""
        steady = self.cycles[1:] or self.cycles
        return sum(steady) / len(steady)


def write_trace(args: LoopArgs, part: str, trace: list | None, step: int) -> None:
    """A traced step's actions (:meth:`StepClock.take_trace` of the group's rank 0) in
    ``<run>/trace/`` on the run's storage (:func:`ray_disagg.run_files.write_trace`; wall
    clock seconds)."""
    if trace is None or args.run_dir is None:
        return
    keys = ("action", "start", "end", "waiting")
    try:
        run_files.write_trace(args.run_dir, part, step + 1, [dict(zip(keys, a)) for a in trace])
    except Exception as e:  # noqa: BLE001 - a trace never stops the training
        log_line(f"{part}: could not write the trace of step {step + 1} ({e})")
