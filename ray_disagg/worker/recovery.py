"""Restart only the failed group: the surviving LLM group's side.

When a worker of an encoder group dies, the coordinator replaces that group alone
(:meth:`ray_disagg.launch.recovery.restart.GroupRecovery.restart`); the LLM group
keeps its processes, process groups and built model. Its ranks:

1. notice the failure as a failed cross-group transfer (the dead peer's connections
   close at once). :func:`guarded` marks the step failed and closes this rank's side
   channel, which in turn releases any peer blocked in a transfer with this rank; the
   rank then skips its remaining transfers of the step but still joins its own group's
   collectives, so every rank of the group issues the same ones;
2. agree at fixed points of the step (:func:`agree`: before each microbatch's compute,
   after the step's last transfer, after each cross-group all-reduce): one small gloo
   all-reduce over the group says whether any rank saw a failure, and if so every rank
   leaves the step together (:class:`GroupFailed`), before any further collective;
3. :func:`recover`: park until the coordinator names the run's latest checkpoint, load
   it in place (model, optimizer, step) while the failed group starts again, wait for the
   rebuilt channel and continue from the checkpoint's step, as the replaced group does.

Only the LLM group runs this (``LoopArgs.group_recovery``); elsewhere a failed transfer
raises as before and Ray Train restarts every group.
"""

from __future__ import annotations

import gc
import logging

import torch
import torch.distributed as dist

from ray_disagg.transport.channel import TransferError
from ray_disagg.worker import checkpoint
from ray_disagg.worker.console import log_line
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.part_worker import PartWorker
from ray_disagg.worker.session import get_session

logger = logging.getLogger(__name__)

__all__ = ["GroupFailed", "agree", "guarded", "recover"]


class GroupFailed(Exception):
    """Another group failed during this step; every rank of this group left the step."""


def enabled(ctx: WorkerContext) -> bool:
    return ctx.args.group_recovery and ctx.is_llm


def guarded(w: PartWorker, fn, *args, default=None):
    """``fn(*args)`` (a cross-group transfer). With group recovery, a failed transfer marks
    the step failed, closes the channel and returns ``default``; once failed, later
    transfers of the step are skipped (``default``)."""
    if not enabled(w.ctx):
        return fn(*args)
    if w.state.peer_failed:
        return default
    try:
        return fn(*args)
    except TransferError as e:
        logger.warning("[%s rank %d] %s", w.ctx.part, w.ctx.group_rank, e)
        w.state.mark_peer_failed()
    _drop_channel(w)
    return default


def _drop_channel(w: PartWorker) -> None:
    """Close the side channel and drop every reference to its gloo group (its
    connections close only when it is freed; a failed wait's traceback holds it too)."""
    w.ctx.channel.close(abort=True)
    w.state.drop_pending()
    gc.collect()


def agree(w: PartWorker) -> None:
    """Raise :class:`GroupFailed` on every rank of the group when any rank saw a failed
    transfer (a collective over the group: every rank calls it at the same points)."""
    ctx = w.ctx
    if not enabled(ctx):
        return
    flag = torch.tensor([int(w.state.peer_failed)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.rt.object_group)  # gloo, host
    if int(flag):
        raise GroupFailed(f"{ctx.part} rank {ctx.group_rank}: another group failed")


def recover(w: PartWorker, model) -> int:
    """Wait for the rebuilt channel, load the latest checkpoint in place; returns the
    step to continue from."""
    if not w.ctx.channel.closed:  # a rank that only heard of it in agree()
        _drop_channel(w)
    ctx = w.ctx  # the failed generation's
    generation, timeout = ctx.channel.spec.generation, ctx.args.recovery_timeout_s
    get_session().wait_reports(timeout)  # an async upload's report, polled before it parks
    resume = ctx.rt.wait_resume(generation, timeout)
    checkpoint.drop(w.writer)  # an unreported asynchronous one of the failed run
    w.opt.zero_grad(set_to_none=True)
    log = log_line if ctx.group_rank == 0 else None
    # while the failed group starts again
    start, _ = checkpoint.restore(
        model, w.opt, ctx.part, ctx.args, log=log, ckpt=resume, writer=w.writer
    )
    ctx.rt.reloaded.set()
    w.rejoin(ctx.rt.wait_rejoin(generation, timeout))  # an elastic group may have resized
    if log is not None:
        failed = [g for g, n in w.ctx.channel.spec.restarts.items() if n]
        log(
            f"{ctx.part}: kept its workers while {', '.join(failed)} restarted; continuing "
            f"from the latest checkpoint at step {start + 1}/{ctx.cfg.max_steps}"
        )
    return start
