"""What the driver prints while a run trains: a start summary (the layout, workers and
parameters per group), one line per reported step (step/N, loss, lr, tokens/s, MFU, step
time, ETA) or a live bar when stdout is a terminal, and an end summary (wall time,
tokens, tokens/s, MFU, peak memory and MFU per group, restarts, the last checkpoint).

The steps come through Ray Train's report path (the coordinator's
:class:`~ray_disagg.launch.step_feed.StepFeed`), polled by :class:`Progress` while
``fit()`` waits; the formatting is pure functions (:func:`step_line`, :func:`start_lines`,
:func:`end_lines`). Each step also goes to the run's metrics history
(:mod:`ray_disagg.run_files`), Ray's metrics (:mod:`ray_disagg.launch.ray_metrics`) and
the experiment trackers.

Example:
    >>> step_line({"step": 3, "loss": 1.25, "lr": 1e-3, "tokens_per_s": 900.0,
    ...            "step_time_s": 0.5, "mean_step_time_s": 0.5}, max_steps=11)
    'step 3/11 loss 1.2500 lr 0.001 tokens/s 900 step 0.500s ETA 0:00:04'
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import threading
import time
import warnings
from collections.abc import Callable

from ray.exceptions import RayActorError

from ray_disagg.run_files import MetricsHistory

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
    (``val_loss`` when the step evaluated; DPO's ``rewards/margins``, GRPO's ``reward``; ``MFU``
    when the devices' peak is known; ``(data wait ...s)`` when waiting for the step's data
    took a tenth of it or more)."""
    left = (max_steps - m["step"]) * m.get("mean_step_time_s", m["step_time_s"])
    parts = [f"step {m['step']}/{max_steps}", f"loss {m['loss']:.4f}"]
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
    if "rewards/margins" in m:
        parts.append(f"margin {m['rewards/margins']:.4f}")
    if "reward" in m:
        parts.append(f"reward {m['reward']:.4f}")
    parts += [f"lr {m['lr']:.3g}", f"tokens/s {m['tokens_per_s']:.0f}"]
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    parts.append(f"step {m['step_time_s']:.3f}s")
    data = max((v for k, v in m.items() if k.endswith("_data_wait_s")), default=0.0)
    if data > 0 and data >= 0.1 * m["step_time_s"]:
        parts.append(f"(data wait {data:.3f}s)")
    parts.append(f"ETA {format_eta(left)}")
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
    """The run's totals from its reported steps ``rows``."""
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


class Progress(threading.Thread):
    """Takes the run's new reported steps from ``fetch(n)`` (the steps after the first
    ``n``: the coordinator's :class:`~ray_disagg.launch.step_feed.StepFeed`) every
    ``interval_s`` and prints each (a line, or a ``tqdm`` bar when ``stream`` is a
    terminal) until :meth:`stop`; each also goes to ``on_step`` (the history, trackers,
    gauges), and ``on_tick`` runs after every poll. ``rows`` keeps every step seen (a
    restart's repeated steps replace theirs). A ``fetch`` that raises ``TimeoutError``
    (the coordinator busy) is tried again at the next poll; one that raises
    ``RayActorError`` (the coordinator gone) ends the polling."""

    def __init__(self, fetch: Callable[[int], list[dict]], max_steps: int,
                 interval_s: float = 0.25, stream=None,
                 echo: Callable[[str], None] | None = None,
                 on_step: Callable[[dict], None] | None = None,
                 on_tick: Callable[[], None] | None = None):  # fmt: skip
        super().__init__(daemon=True, name="ray_disagg-progress")
        self.fetch, self.max_steps, self.interval_s = fetch, max_steps, interval_s
        self.on_step, self.on_tick = on_step, on_tick
        self.stream = stream or sys.stdout
        self.echo = echo or (lambda line: print(PREFIX + line, file=self.stream, flush=True))
        self.taken = 0
        self.steps: dict[int, dict] = {}
        self.done = threading.Event()
        self.gone = False
        self.lock = threading.Lock()  # one poll at a time (the thread's, the last ones)
        self.bar = None

    @property
    def rows(self) -> list[dict]:
        return [self.steps[s] for s in sorted(self.steps)]

    def run(self) -> None:
        while not self.done.wait(self.interval_s) and not self.gone:
            self.poll()

    def stop(self, attempts: int = 3) -> None:
        """Stop polling, then take the steps not taken yet (while the coordinator answers,
        up to ``attempts`` tries when it is slow to)."""
        self.done.set()
        if self.ident is not None:  # (started)
            self.join(timeout=30)
        for _ in range(attempts):
            if self.gone or self.poll() is not None:
                break
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def poll(self) -> int | None:
        """Show the new steps; their number, or ``None`` when ``fetch`` timed out (or the
        coordinator is gone: :attr:`gone`)."""
        with self.lock:
            if self.gone:
                return None
            try:
                rows = self.fetch(self.taken)
            except TimeoutError:
                return None
            except RayActorError:  # the coordinator died: fit() raises what happened
                self.gone = True
                return None
            for m in rows:
                self.taken += 1
                self.steps[m["step"]] = m
                self.show(m)
                if self.on_step is not None:
                    self.on_step(m)
            if self.on_tick is not None:
                self.on_tick()
            return len(rows)

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
    """The driver's side of one ``fit()`` of a ``DisaggregatedTrainer``: the start lines on
    entry; a :class:`Progress` taking each reported step from ``fetch`` (the coordinator's
    feed) to the display, the run's metrics history on its storage
    (:class:`~ray_disagg.run_files.MetricsHistory`), Ray's gauges and the trackers; the
    end lines in :meth:`finish`. The same on every storage: no file is read."""

    def __init__(self, trainer, fetch: Callable[[int], list[dict]],
                 echo: Callable[[str], None] | None = None):  # fmt: skip
        self.trainer, self.fetch, self.t0 = trainer, fetch, time.monotonic()
        self.echo = echo or (lambda line: print(PREFIX + line, flush=True))
        self.progress = self.trackers = self.history = None

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
        self.history = MetricsHistory(t.run_dir())
        sinks, tick = self._sinks(), self.history.flush_if_due
        self.progress = Progress(self.fetch, cfg.max_steps, echo=self.echo, on_step=sinks,
                                 on_tick=tick)  # fmt: skip
        self.progress.start()
        return self

    def take(self) -> None:
        """Take the steps reported so far (before the run is aborted)."""
        if self.progress is not None:
            self.progress.poll()

    def _sinks(self) -> Callable[[dict], None]:
        """Where each step's metrics go besides the display: the history, Ray's metrics
        and the trackers (``report_to``)."""
        from ray_disagg.launch.ray_metrics import RayMetrics

        t = self.trainer
        sinks = [self.history.add]
        try:
            sinks.append(RayMetrics(t.run_config.name, t.groups).log)
        except Exception as e:  # noqa: BLE001 - the run goes on without Ray's gauges
            warnings.warn(f"Ray metrics are not recorded: {e!r}", stacklevel=2)
        if t.report_to:
            from ray_disagg.launch.trackers import Trackers, run_params

            where = t.tracker_dir()
            self.trackers = Trackers(t.report_to, where, t.run_config.name, run_params(t))
            sinks.append(self.trackers.log)

        failed = set()

        def log(m: dict) -> None:
            for sink in sinks:
                try:
                    sink(m)
                except Exception as e:  # noqa: BLE001 - one sink never stops the others
                    if sink not in failed:
                        failed.add(sink)
                        warnings.warn(f"A step's metrics were not recorded: {e!r}", stacklevel=2)

        return log

    def finish(self, result):
        """Take the last steps and print the end lines; returns ``result`` (a
        ``ray.train.Result``)."""
        self._stop()
        checkpoint = None if result.checkpoint is None else result.checkpoint.path
        wall = time.monotonic() - self.t0
        for line in end_lines(self.progress.rows, self.trainer.groups, wall, checkpoint):
            self.echo(line)
        return result

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        """The steps not taken yet taken, the history written, the trackers closed (once)."""
        if self.progress is not None and not self.progress.done.is_set():
            self.progress.stop()
        if self.history is not None:
            self.history.close()
            self.history = None
        if self.trackers is not None:
            self.trackers.finish()
            self.trackers = None
