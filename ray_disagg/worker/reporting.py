"""When a step is reported and what the report does: the cadence (``report_every``,
evaluation and checkpoint steps), each group's learning rate, the metrics (printed by the
LLM group's rank 0 when no driver prints them), and the report itself, with a checkpoint
at checkpoint steps (:mod:`ray_disagg.worker.checkpoint`). The report carries the step's
metrics to the driver, which keeps the run's history (:mod:`ray_disagg.run_files`)."""

from __future__ import annotations

import time

from ray_disagg.config.lr_schedule import lr_at
from ray_disagg.worker import checkpoint
from ray_disagg.worker.checkpoint import is_checkpoint_step
from ray_disagg.worker.clock import StepClock
from ray_disagg.worker.console import log_step
from ray_disagg.worker.shards import ShardWriter

__all__ = ["group_lrs", "is_eval_step", "is_reported_step", "maybe_report"]


def group_lrs(args, step: int) -> dict[str, float]:
    """``lr`` (the schedule's) and ``<group>_lr`` (times its multiplier; 0 when frozen)."""
    out = {"lr": lr_at(args.cfg, step)}
    for name, g in args.groups.items():
        frozen = name in args.frozen_parts
        out[f"{name}_lr"] = 0.0 if frozen else lr_at(args.cfg, step, g.lr_multiplier)
    return out


def is_eval_step(args, step: int) -> bool:
    """Validation runs every ``eval_every`` steps and at every checkpoint step."""
    if args.val_plan is None:
        return False
    every = args.cfg.eval_every
    return is_checkpoint_step(args.cfg, step) or (every is not None and (step + 1) % every == 0)


def is_reported_step(args, step: int) -> bool:
    """Every ``report_every`` steps, checkpoint steps and evaluation steps (``val_loss``)."""
    cfg = args.cfg
    reported = is_checkpoint_step(cfg, step) or (step + 1) % cfg.report_every == 0
    return reported or is_eval_step(args, step)


def maybe_report(
    args, stats, step: int, writer: ShardWriter, clock: StepClock, model, optimizer, extra,
    background=None,
):  # fmt: skip
    """On the steps every rank agrees on (each ``report_every``, evaluation and checkpoint
    steps, the last): the step's metrics, printed by the LLM group's rank 0 when no driver
    prints them, then reported, with a checkpoint at checkpoint steps
    (:func:`ray_disagg.worker.checkpoint.maybe_save`). First an asynchronous checkpoint
    whose files every rank has written is reported."""
    t0 = time.perf_counter()
    must = is_checkpoint_step(args.cfg, step)  # the last step is one too
    checkpoint.flush(writer, ready=must or stats[args.stats.index["checkpoint_writing"]] == 0)
    if not is_reported_step(args, step):
        clock.exclude(time.perf_counter() - t0)
        return
    epoch = args.plan.epoch_of(step)
    metrics = args.stats.metrics(stats, step, epoch, group_lrs(args, step), clock.mean_step_time)
    metrics.update(extra)
    if writer.module == args.adapter.llm_part and writer.lead and not args.driver_progress:
        log_step(metrics, args.cfg.max_steps)
    checkpoint.maybe_save(args, step, metrics, writer, model, optimizer, background)
    clock.exclude(time.perf_counter() - t0)
