"""What the driver prints while a run trains: a start summary (the layout, workers and
parameters per group), one line per reported step (step/N, loss, lr, tokens/s, MFU, step
time, ETA) or a live bar when stdout is a terminal, and an end summary (wall time,
tokens, tokens/s, MFU, peak memory and MFU per group, restarts, the last checkpoint).

The steps come from the run's ``metrics.jsonl`` (written by the LLM group's rank 0 at every
reported step), polled by :class:`Progress` while ``fit()`` waits; the formatting is pure
functions (:func:`step_line`, :func:`start_lines`, :func:`end_lines`). Each step also goes
to Ray's metrics (:mod:`ray_disagg.launch.ray_metrics`) and the experiment trackers.

Example:
    >>> step_line({"step": 3, "loss": 1.25, "lr": 1e-3, "tokens_per_s": 900.0,
    ...            "step_time_s": 0.5, "mean_step_time_s": 0.5}, max_steps=11)
    'step 3/11 loss 1.2500 lr 0.001 tokens/s 900 step 0.500s ETA 0:00:04'
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable

__all__ = [
    "Progress",
    "RunProgress",
    "end_lines",
    "format_count",
    "format_eta",
    "start_lines",
    "step_line",
]

PREFIX = "[ray_disagg] "


def format_eta(seconds: float | None) -> str:
    """``h:mm:ss`` (``?`` when unknown)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def format_count(n: float) -> str:
    """``306.8M``, ``1.2B``, ``49.1K``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def step_line(m: dict, max_steps: int) -> str:
    """One reported step: ``step s/N loss ... lr ... tokens/s ... step ...s ETA h:mm:ss``
    (``val_loss`` when the step evaluated; an objective's ``rewards/margins``; ``MFU``
    when the devices' peak is known)."""
    left = (max_steps - m["step"]) * m.get("mean_step_time_s", m["step_time_s"])
    parts = [f"step {m['step']}/{max_steps}", f"loss {m['loss']:.4f}"]
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
    if "rewards/margins" in m:
        parts.append(f"margin {m['rewards/margins']:.4f}")
    parts += [f"lr {m['lr']:.3g}", f"tokens/s {m['tokens_per_s']:.0f}"]
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    parts += [f"step {m['step_time_s']:.3f}s", f"ETA {format_eta(left)}"]
    return " ".join(parts)


def start_lines(groups: dict, params: dict[str, int], max_steps: int, name: str) -> list[str]:
    """The layout: per group its workers, parallelism and parameters."""
    out = [f"run {name!r}: {max_steps} steps, groups:"]
    for g, group in groups.items():
        par = _describe(group.parallelism)
        lora = ", LoRA" if getattr(group, "peft_config", None) is not None else ""
        frozen = ", frozen" if not group.trainable else ""
        out.append(
            f"  {g}: {group.num_workers} worker(s), parallelism {par}{lora}{frozen}, "
            f"{format_count(params.get(g, 0))} parameters"
        )
    return out


def _describe(p) -> str:
    """``DataParallel(fsdp=True)``: the parallelism's class and its non-default settings."""
    if not dataclasses.is_dataclass(p):
        return str(p)
    changed = [
        f"{f.name}={getattr(p, f.name)!r}"
        for f in dataclasses.fields(p)
        if f.default is not dataclasses.MISSING and getattr(p, f.name) != f.default
    ]
    return f"{type(p).__name__}({', '.join(changed)})"


def end_lines(rows: list[dict], groups, wall_s: float, checkpoint: str | None) -> list[str]:
    """The run's totals from its reported steps ``rows`` (``metrics.jsonl``)."""
    if not rows:
        return [f"done in {format_eta(wall_s)}: no step was reported"]
    last = rows[-1]
    tokens = sum(r.get("tokens_per_s", 0.0) * r.get("step_time_s", 0.0) for r in rows)
    train_s = sum(r.get("step_time_s", 0.0) for r in rows)
    out = [
        f"done: {last['step']} steps in {format_eta(wall_s)} (wall), final loss "
        f"{last['loss']:.4f}, {tokens:,.0f} tokens in the reported steps, "
        f"{tokens / max(train_s, 1e-9):,.0f} tokens/s{_mean_mfu(rows, 'mfu')}"
    ]
    for g in groups:
        peak = max(r.get(f"{g}_peak_memory_mb", 0.0) for r in rows)
        restarts = max(r.get(f"{g}_restarts", 0) for r in rows)
        out.append(
            f"  {g}: peak memory {peak:,.0f} MB (rank 0), restarts {restarts}"
            f"{_mean_mfu(rows, f'{g}_mfu')}"
        )
    out.append(f"  last checkpoint: {checkpoint or 'none'}")
    return out


def _mean_mfu(rows: list[dict], key: str) -> str:
    """``, MFU 41.2%``: ``key``'s mean over the reported steps weighted by their time
    (empty when no step has it)."""
    timed = [(r[key], r.get("step_time_s", 0.0)) for r in rows if key in r]
    total = sum(t for _, t in timed)
    if not timed or total <= 0:
        return ""
    return f", MFU {100 * sum(m * t for m, t in timed) / total:.1f}%"


def _read_rows(path: str, offset: int) -> tuple[list[dict], int]:
    """Complete lines of ``path`` from byte ``offset`` on, and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows, offset + end


class Progress(threading.Thread):
    """Polls ``path`` (the run's ``metrics.jsonl``) every ``interval_s`` and prints each
    new step (a line, or a ``tqdm`` bar when ``stream`` is a terminal) until
    :meth:`stop`. ``rows`` keeps every step seen (a restart's repeated steps replace
    theirs)."""

    def __init__(self, path: str, max_steps: int, interval_s: float = 1.0, stream=None,
                 echo: Callable[[str], None] | None = None,
                 on_step: Callable[[dict], None] | None = None):  # fmt: skip
        super().__init__(daemon=True, name="ray_disagg-progress")
        self.path, self.max_steps, self.interval_s = path, max_steps, interval_s
        self.on_step = on_step  # each new step's metrics also go here (the trackers)
        self.stream = stream or sys.stdout
        self.echo = echo or (lambda line: print(PREFIX + line, file=self.stream, flush=True))
        self.offset = os.path.getsize(path) if os.path.isfile(path) else 0  # a resumed run's
        self.steps: dict[int, dict] = {}
        self.done = threading.Event()
        self.bar = None

    @property
    def rows(self) -> list[dict]:
        return [self.steps[s] for s in sorted(self.steps)]

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            self.poll()
        self.poll()
        if self.bar is not None:
            self.bar.close()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)

    def poll(self) -> None:
        rows, self.offset = _read_rows(self.path, self.offset)
        for m in rows:
            self.steps[m["step"]] = m
            self.show(m)
            if self.on_step is not None:
                self.on_step(m)

    def show(self, m: dict) -> None:
        line = step_line(m, self.max_steps)
        if not getattr(self.stream, "isatty", lambda: False)():
            self.echo(line)
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.max_steps, file=self.stream, dynamic_ncols=True)
        self.bar.n = m["step"]
        self.bar.set_description_str(line.split(" ETA")[0], refresh=True)


class RunProgress:
    """The driver's output around one ``fit()`` of a ``DisaggregatedTrainer``: the start
    lines on entry, a :class:`Progress` polling the run's metrics file (when it is on a
    local or mounted path), the end lines in :meth:`finish`."""

    def __init__(self, trainer, echo: Callable[[str], None] | None = None):
        self.trainer, self.t0 = trainer, time.monotonic()
        self.echo = echo or (lambda line: print(PREFIX + line, flush=True))
        self.progress = self.trackers = None

    def __enter__(self) -> RunProgress:
        t = self.trainer
        spec, cfg = t.model_spec, t.loop_config
        model = spec.meta_model()  # once, on ``meta``: each group counts its part of it
        params = {
            g: sum({id(p): p.numel() for _, p in spec.adapter.part_parameters(model, g)}.values())
            for g in t.groups
        }
        for line in start_lines(t.groups, params, cfg.max_steps, t.run_config.name):
            self.echo(line)
        path = t.metrics_file()
        if path is not None:
            sinks = self._sinks(os.path.dirname(path))
            self.progress = Progress(  # (its offset now: a resumed run's old steps skipped)
                path, cfg.max_steps, echo=self.echo, on_step=sinks
            )
            self.progress.start()
        return self

    def _sinks(self, run_dir: str) -> Callable[[dict], None]:
        """Where each step's metrics go besides the display: Ray's metrics and the
        trackers (``report_to``)."""
        from ray_disagg.launch.ray_metrics import RayMetrics

        t = self.trainer
        sinks = []
        try:
            sinks.append(RayMetrics(t.run_config.name, t.groups).log)
        except Exception as e:  # noqa: BLE001 - the run goes on without Ray's gauges
            warnings.warn(f"Ray metrics are not recorded: {e!r}", stacklevel=2)
        if t.report_to:
            from ray_disagg.launch.trackers import Trackers, run_params

            self.trackers = Trackers(t.report_to, run_dir, t.run_config.name, run_params(t))
            sinks.append(self.trackers.log)

        def log(m: dict) -> None:
            for sink in sinks:
                sink(m)

        return log

    def finish(self, result):
        """Print the end lines; returns ``result`` (a ``ray.train.Result``)."""
        if self.progress is None:
            return result
        self.progress.stop()
        self._close_trackers()
        checkpoint = None if result.checkpoint is None else result.checkpoint.path
        wall = time.monotonic() - self.t0
        for line in end_lines(self.progress.rows, self.trainer.groups, wall, checkpoint):
            self.echo(line)
        return result

    def __exit__(self, *exc) -> None:
        if self.progress is not None and self.progress.is_alive():
            self.progress.stop()
        self._close_trackers()

    def _close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.finish()
            self.trackers = None
