"""The end of a step, as named pieces: reduce the gradients, the stats exchange, the
global gradient norm, the skip policy, clipping, the learning rate, the optimizer step,
validation and the report. Every rank of every group runs :func:`finish_step` once a
step and decides alike, from the exchanged stats."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ray_disagg.lr_schedule import lr_at
from ray_disagg.parallel import expert_parallel as ep
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.parallel.data_parallel import all_reduce_gradients
from ray_disagg.worker import background_save, metrics, recovery

logger = logging.getLogger(__name__)


class NoOptimizer:
    """The optimizer of a group with nothing to train (every parameter frozen)."""

    state: dict = {}
    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg, zero1: bool):
    """AdamW; with ``zero1`` its state is sharded over the default (whole group's) process
    group by ``ZeroRedundancyOptimizer`` (each rank updates its shard, then broadcasts).
    No trainable parameter: :class:`NoOptimizer`. The learning rate is set every step
    (:func:`set_lr`)."""
    params = list(params)
    if not params:
        return NoOptimizer()
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
    if _mixed_kinds(params):  # foreach kernels reject plain tensors next to DTensors
        kwargs["foreach"] = False
    return torch.optim.AdamW(params, **kwargs)


def _mixed_kinds(params) -> bool:
    """Plain tensors next to DTensors (TP's replicated norms, expert-parallel experts
    next to data-parallel weights): CUDA's default foreach AdamW refuses the mix."""
    from torch.distributed.tensor import DTensor

    return len({isinstance(p, DTensor) for p in params}) > 1


def set_lr(optimizer, cfg, step: int, multiplier: float) -> float:
    """The scheduled learning rate of ``step`` times the group's multiplier, set on every
    parameter group (ZeRO-1 copies it into its local optimizer on ``step()``)."""
    lr = lr_at(cfg, step, multiplier)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def clip_coef(total_norm: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, clamped to 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@torch.no_grad()
def scale_grads(params: Iterable[torch.nn.Parameter], coef: float) -> None:
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def reduce_grads(w) -> None:
    """Sum the gradients over the ranks that hold the same weights (``w.shard_mesh``: tp:
    over ``dp``, whose replicas differ in samples only; cp x tp: over ``dp x cp``; dp, sp
    and cp: over the whole group, whose sp / cp ranks hold partial sums of the replicated
    weights); FSDP2 reduce-scattered them in backward already. TP: the partial sums of the
    replicated norms over ``tp``. Expert-parallel experts: over the ranks holding the
    same experts (``ep_replica``)."""
    ids = {id(p) for p in ep.expert_parameters(w.model)}
    experts = [p for p in w.params if id(p) in ids]
    if not w.fsdp:
        reduce = dist.group.WORLD if w.shard_mesh is None else w.shard_mesh.get_group()
        all_reduce_gradients([p for p in w.params if id(p) not in ids], reduce)
    if experts:  # expert parallel: over the ranks holding the same experts
        all_reduce_gradients(experts, w.expert_mesh["ep_replica"].get_group())
    if w.is_tp:
        tp.all_reduce_partial_grads(w.params, w.tp_mesh.get_group())


def group_had_inputs(w, stats) -> bool:
    """Whether any rank of this group had real inputs this step (the LLM group always;
    an encoder group when its counters, e.g. ``images + videos``, are not all 0)."""
    if w.is_llm:
        return True
    ix = w.args.stats.index
    return sum(stats[ix[c]] for c in w.adapter.counter_names(w.part)) > 0


def should_apply(w, step: int, stats, total_norm: float, sample_ids) -> bool:
    """A batch with no label token is skipped (its loss is reported as NaN); a non-finite
    loss or gradient norm raises, or is skipped with ``skip_nonfinite_steps``."""
    ix = w.args.stats.index
    if stats[ix["label_tokens"]] == 0:
        stats[ix["loss"]] = float("nan")
        if w.group_rank == 0 and w.is_llm:
            logger.warning("step %d: the global batch has no label token; skipped", step + 1)
        return False
    loss = float(stats[ix["loss"]])
    if math.isfinite(loss) and math.isfinite(total_norm):
        return True
    if w.cfg.skip_nonfinite_steps:
        return False
    raise FloatingPointError(
        f"step {step + 1}: loss {loss} / global grad norm {total_norm} is not finite; the "
        f"step was not applied. Samples of this {w.part} worker: {list(sample_ids)}. "
        "Check these samples (e.g. NaN pixels) or set "
        "train_loop_config={'skip_nonfinite_steps': True} to skip such steps."
    )


def apply_update(w, step: int, total_norm: float) -> None:
    """Clip to the global norm, set the scheduled learning rate, step the optimizer."""
    scale_grads(w.params, clip_coef(total_norm, w.cfg.max_grad_norm))
    set_lr(w.opt, w.cfg, step, w.group.lr_multiplier)
    background_save.wait_staged(w.writer)  # a checkpoint's copy of the state, still running
    w.opt.step()


def validate(w, evaluate, step: int) -> dict:
    """``val_loss``: the validation set's summed token losses over its label tokens,
    all-reduced over every rank of every group (its time is not step time)."""
    t0 = time.perf_counter()
    local = torch.tensor(evaluate(step), dtype=torch.float64)
    sums = recovery.guarded(w, w.channel.all_reduce_sum, local, default=local)
    recovery.agree(w)
    w.clock.excluded += time.perf_counter() - t0
    loss_sum, labels = float(sums[0]), float(sums[1])
    return {"val_loss": loss_sum / labels if labels else float("nan")}


def finish_step(w, step: int, stats, *, sample_ids=(), inflight=1, evaluate=None, extra=None):
    """Reduce, exchange the step's stats, clip, step at the scheduled learning rate, run
    ``evaluate(step)`` (this rank's ``[loss sum, label tokens]`` of the validation set) on
    evaluation steps, and report."""
    with w.clock.span(waiting=False):
        reduce_grads(w)
        sq = tp.grad_sq_norm(w.params, dist.group.WORLD, w.device)
    metrics.record(w, stats, sq, inflight)
    is_timer = w.is_llm and w.group_rank == 0
    args = (w.channel, stats, w.args.stats, is_timer)
    stats = recovery.guarded(w, w.clock.exchange, *args, default=stats)
    recovery.agree(w)  # every rank has the global stats, or the step is abandoned
    metrics.write_trace(w, step)  # a traced step's actions, once it is not abandoned
    total_norm = w.args.stats.total_norm(stats)
    if w.fsdp and not group_had_inputs(w, stats):
        for p in w.params:  # every rank ran a stand-in: zero gradients, not real ones
            p.grad = None  # so AdamW skips these parameters, as single-process does
    if should_apply(w, step, stats, total_norm, sample_ids):
        apply_update(w, step, total_norm)
    else:
        w.skipped += 1
    w.opt.zero_grad(set_to_none=True)
    fallbacks = int(stats[w.args.stats.index["transfer_fallbacks"]])
    extra = {**(extra or {}), "skipped_steps": w.skipped, **metrics.placement_metrics(w, fallbacks)}
    if evaluate is not None and metrics.is_eval_step(w.args, step):
        extra.update(validate(w, evaluate, step))
    args = (w.args, stats, step, w.writer, w.clock, w.model, w.opt, extra)
    metrics.maybe_report(*args, background=w.rt.checkpoint_group)
    first = step == w.start and not metrics.is_reported_step(w.args, step)
    if first and w.group_rank == 0 and w.is_llm:
        metrics.log_line(f"step {step + 1}/{w.cfg.max_steps} done (first of this run)")
