"""The end of a step, in four phases that each group's step calls in order (``worker/
llm_step.py``, ``worker/encoder.py``): :func:`reduce` the gradients, :func:`exchange` the
step's stats over every rank of every group, :func:`apply` the update (the skip policy,
clipping to the global norm, the scheduled learning rate, the optimizer step), and
:func:`report` (validation, the metrics, a checkpoint at checkpoint steps). Every rank of
every group runs them once a step and decides alike, from the exchanged stats."""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from ray_disagg.parallel import expert_parallel as ep
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.parallel.data_parallel import all_reduce_gradients
from ray_disagg.worker import metrics, recovery, reporting
from ray_disagg.worker.clock import write_trace
from ray_disagg.worker.console import log_line
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.optim import clip_coef, scale_grads, set_lr
from ray_disagg.worker.part_worker import PartWorker

logger = logging.getLogger(__name__)


def reduce_grads(w: PartWorker) -> None:
    """Sum the gradients over the ranks that hold the same weights (``ctx.shard_mesh``: tp:
    over ``dp``, whose replicas differ in samples only; cp x tp: over ``dp x cp``; dp, sp
    and cp: over the whole group, whose sp / cp ranks hold partial sums of the replicated
    weights); FSDP2 reduce-scattered them in backward already. TP: the partial sums of the
    replicated norms over ``tp``. Expert-parallel experts: over the ranks holding the
    same experts (``ep_replica``)."""
    ctx = w.ctx
    ids = {id(p) for p in ep.expert_parameters(w.model)}
    experts = [p for p in w.params if id(p) in ids]
    if not ctx.fsdp:
        reduce = dist.group.WORLD if ctx.shard_mesh is None else ctx.shard_mesh.get_group()
        all_reduce_gradients([p for p in w.params if id(p) not in ids], reduce)
    if experts:  # expert parallel: over the ranks holding the same experts
        all_reduce_gradients(experts, ctx.expert_mesh["ep_replica"].get_group())
    if ctx.is_tp:
        tp.all_reduce_partial_grads(w.params, ctx.tp_mesh.get_group())


def group_had_inputs(ctx: WorkerContext, stats) -> bool:
    """Whether any rank of this group had real inputs this step (the LLM group always;
    an encoder group when its counters, e.g. ``images + videos``, are not all 0)."""
    if ctx.is_llm:
        return True
    ix = ctx.args.stats.index
    return sum(stats[ix[c]] for c in ctx.adapter.counter_names(ctx.part)) > 0


def should_apply(ctx: WorkerContext, step: int, stats, total_norm: float, sample_ids) -> bool:
    """A batch with no label token is skipped (its loss is reported as NaN); a non-finite
    loss or gradient norm raises, or is skipped with ``skip_nonfinite_steps``."""
    ix = ctx.args.stats.index
    if stats[ix["label_tokens"]] == 0:
        stats[ix["loss"]] = float("nan")
        if ctx.group_rank == 0 and ctx.is_llm:
            logger.warning("step %d: the global batch has no label token; skipped", step + 1)
        return False
    loss = float(stats[ix["loss"]])
    if math.isfinite(loss) and math.isfinite(total_norm):
        return True
    if ctx.cfg.skip_nonfinite_steps:
        return False
    raise FloatingPointError(
        f"step {step + 1}: loss {loss} / global grad norm {total_norm} is not finite; the "
        f"step was not applied. Samples of this {ctx.part} worker: {list(sample_ids)}. "
        "Check these samples (e.g. NaN pixels) or set "
        "train_loop_config={'skip_nonfinite_steps': True} to skip such steps."
    )


def apply_update(w: PartWorker, step: int, total_norm: float) -> None:
    """Clip to the global norm, set the scheduled learning rate, step the optimizer."""
    cfg = w.ctx.cfg
    scale_grads(w.params, clip_coef(total_norm, cfg.max_grad_norm))
    set_lr(w.opt, cfg, step, w.ctx.group.lr_multiplier)
    w.writer.wait_staged()  # a checkpoint's copy of the state, still running
    w.opt.step()


def validate(w: PartWorker, evaluate, step: int) -> dict:
    """``val_loss``: the validation set's summed token losses over its label tokens (or,
    for a generating objective, its rewards of greedy completions), all-reduced over
    every rank of every group (its time is not step time)."""
    clock, t0 = w.state.clock, time.perf_counter()
    with clock.paused():  # the validation pass's spans are not the next step's times
        local = torch.tensor(evaluate(step), dtype=torch.float64)
    sums = recovery.guarded(w, w.ctx.channel.all_reduce_sum, local, default=local)
    recovery.agree(w)
    clock.exclude(time.perf_counter() - t0)
    obj = w.ctx.cfg.objective
    if obj is not None and obj.generates:  # GRPO: the rewards of greedy completions
        return obj.eval_metrics([float(v) for v in sums])
    loss_sum, labels = float(sums[0]), float(sums[1])
    return {"val_loss": loss_sum / labels if labels else float("nan")}


def eval_width(cfg) -> int:
    """Length of a rank's validation sums (:func:`validate`)."""
    obj = cfg.objective
    return obj.eval_width if obj is not None and obj.generates else 2


def reduce(w: PartWorker) -> float:
    """Sum the gradients over the ranks that hold the same weights
    (:func:`reduce_grads`); returns this rank's share of the squared gradient norm."""
    with w.state.clock.span(waiting=False):
        reduce_grads(w)
        return tp.grad_sq_norm(w.params, dist.group.WORLD, w.ctx.device)


def exchange(w: PartWorker, step: int, stats, sq: float, inflight: int = 1):
    """The group's own slots (``sq``: its squared gradient norm) and this rank's, then the
    stats summed over every rank of every group, or every rank of the group leaves the
    step (:class:`~ray_disagg.worker.recovery.GroupFailed`); a traced step's actions are
    written once the step is not abandoned. Returns the summed stats."""
    ctx, clock = w.ctx, w.state.clock
    metrics.record(w, stats, sq, inflight)
    is_timer = ctx.is_llm and ctx.group_rank == 0
    args = (ctx.channel, stats, ctx.args.stats, is_timer)
    stats = recovery.guarded(w, clock.exchange, *args, default=stats)
    recovery.agree(w)  # every rank has the global stats, or the step is abandoned
    trace = clock.take_trace()
    if ctx.group_rank == 0:
        write_trace(ctx.args, ctx.part, trace, step)
    return stats


def apply(w: PartWorker, step: int, stats, sample_ids=()) -> None:
    """Step the optimizer at the scheduled learning rate after clipping to the global
    norm, or skip the step (:func:`should_apply`); the gradients are zeroed either way."""
    ctx = w.ctx
    total_norm = ctx.args.stats.total_norm(stats)
    if ctx.fsdp and not group_had_inputs(ctx, stats):
        for p in w.params:  # every rank ran a stand-in: zero gradients, not real ones
            p.grad = None  # so AdamW skips these parameters, as single-process does
    if should_apply(ctx, step, stats, total_norm, sample_ids):
        apply_update(w, step, total_norm)
    else:
        w.state.count_skipped()
    w.opt.zero_grad(set_to_none=True)


def report(w: PartWorker, step: int, stats, evaluate=None, extra=None) -> None:
    """On evaluation steps ``evaluate(step)`` (this rank's ``[loss sum, label tokens]`` of
    the validation set); on reported steps the metrics (``extra`` added), with a
    checkpoint at checkpoint steps (:func:`ray_disagg.worker.reporting.maybe_report`)."""
    ctx = w.ctx
    fallbacks = int(stats[ctx.args.stats.index["transfer_fallbacks"]])
    extra = {**(extra or {}), "skipped_steps": w.state.skipped}
    extra.update(metrics.placement_metrics(ctx, fallbacks))
    if evaluate is not None and reporting.is_eval_step(ctx.args, step):
        extra.update(validate(w, evaluate, step))
    args = (ctx.args, stats, step, w.writer, w.state.clock, w.model, w.opt, extra)
    reporting.maybe_report(*args, background=ctx.rt.checkpoint_group)
    first = step == w.start and not reporting.is_reported_step(ctx.args, step)
    if first and ctx.group_rank == 0 and ctx.is_llm:
        log_line(f"step {step + 1}/{ctx.cfg.max_steps} done (first of this run)")
