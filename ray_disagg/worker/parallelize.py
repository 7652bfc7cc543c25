"""Applying a group's parallelism to its part, on the ``meta`` device, in one place
(:func:`parallelize_part`, called by ``PartWorker.setup`` before FSDP2 shards the part
and its weights are materialized): the LLM's tensor-, context- and expert-parallel plans,
a tower's Ulysses sequence parallelism or tensor-parallel plan, and what packed batches
and context-parallel calls need of the LLM (``adapter.prepare_packing``,
``adapter.prepare_context``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ray_disagg.parallel import context_parallel as cp
from ray_disagg.parallel import expert_parallel as ep
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.parallel import ulysses
from ray_disagg.worker.context import WorkerContext

__all__ = ["ParallelPart", "parallelize_part"]


@dataclass(frozen=True)
class ParallelPart:
    """What the loop needs of the parallelized part."""

    lm_head: nn.Module | None = None
    """The LLM's output projection (``None`` for a tower)."""
    tp_group: Any = None
    """The LLM's tensor-parallel process group (vocab-parallel loss), else ``None``."""
    vocab_start: int = 0
    """The first vocabulary row of this rank's lm_head shard."""


def parallelize_part(ctx: WorkerContext, model: nn.Module) -> ParallelPart:
    """Apply the plans of ``ctx``'s group to its ``model``."""
    adapter = ctx.adapter
    if not ctx.is_llm:
        tower = adapter.part_roots(model, ctx.part)[0]
        if ctx.is_sp and adapter.sp_plan(ctx.part) is not None:  # None: tile SP, tower as is
            ulysses.enable_ulysses(tower)
        if ctx.is_tp:
            tp.parallelize_vision(tower, adapter.tower_tp_plan(ctx.part), ctx.mp_mesh)
        return ParallelPart()
    decoder, lm_head = adapter.llm_modules(model)
    tp_group, vocab_start = None, 0
    if ctx.is_tp:
        plan, norms = adapter.llm_tp_plan(), adapter.per_head_norms
        tp_group, vocab_start = tp.parallelize_text(
            model, decoder, lm_head, ctx.tp_mesh, plan, norms
        )
    if ctx.cfg.pack_sequences:
        adapter.prepare_packing(decoder)
    if ctx.is_cp:
        cp.enable_context_parallel(decoder)
        adapter.prepare_context(decoder)
    if ctx.expert_mesh is not None:
        ep.parallelize_experts(decoder, ctx.expert_mesh["ep"])
    return ParallelPart(lm_head, tp_group, vocab_start)
