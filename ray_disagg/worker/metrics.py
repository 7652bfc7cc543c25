"""What a step measures, into the stats vector every rank sums once a step
(:class:`~ray_disagg.worker.stats.StepStats`): the LLM's loss slots, each group's own
slots (gradient norm, compute and wait time, the wait for the step's inputs, peak
memory), the sample ids, and where tensors went. When and how a step is reported:
:mod:`ray_disagg.worker.reporting`."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ray_disagg.data.mixture import SOURCE_KEY
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.worker import checkpoint, memory
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.part_worker import PartWorker

__all__ = [
    "label_tokens_by_source",
    "placement_metrics",
    "plain",
    "record",
    "sample_ids",
    "source_index",
    "step_stats",
]


def plain(v):
    return v.item() if hasattr(v, "item") else v


def step_stats(ctx: WorkerContext, run, objective_sums=None):
    """The LLM's slots; ``objective_sums``: an objective's metrics (its shares of the
    metric values, then the step's values)."""
    stats = ctx.args.stats.new()
    if ctx.leader:
        ix = ctx.args.stats.index
        stats[ix["loss"]] = float(run.loss_sum)  # after the last gradients were posted
        stats[ix["label_tokens"]] = run.local_labels
        stats[ix["llm_tokens"]] = run.tokens
        stats[ix["samples"]] = len(run.items)
        stats[ix[f"{ctx.part}_flops"]] = run.flops
        if run.by_source is not None:
            sums = run.by_source.tolist()  # after the last gradients were posted
            for src, total, n in zip(ctx.args.sources, sums, run.source_labels):
                stats[ix[f"loss/{src}"]], stats[ix[f"label_tokens/{src}"]] = total, n
        if objective_sums:
            first = ix[ctx.args.stats.objective_metrics[0]]
            stats[first : first + len(objective_sums)] = torch.tensor(
                objective_sums, dtype=torch.float64
            )
    return stats


def source_index(items, sources: tuple[str, ...], device) -> torch.Tensor:
    """The source (index into ``sources``) of each item of a mixture's microbatch."""
    return torch.tensor([sources.index(it[SOURCE_KEY]) for it in items], device=device)


def label_tokens_by_source(ctx: WorkerContext, items) -> list[int]:
    """The label tokens of ``items`` per source of the run's mixture (host counts)."""
    out = [0] * len(ctx.args.sources)
    for it in items:
        out[ctx.args.sources.index(it[SOURCE_KEY])] += count_label_tokens(ctx.adapter.labels(it))
    return out


def sample_ids(ctx: WorkerContext, run) -> tuple[list, dict]:
    """The step's sample ids on this rank and, with ``report_sample_ids``, every
    replica's as the ``sample_ids`` metric (for audits)."""
    ids = [plain(it.get("id")) for it in run.ordered_items()]
    if not ctx.cfg.report_sample_ids:
        return ids, {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids if ctx.leader else [], group=ctx.rt.object_group)
    return ids, {"sample_ids": [i for part in gathered for i in part]}


def record(w: PartWorker, stats, sq: float, inflight: int) -> None:
    """The group's own slots (from its rank 0) and this rank's transfer fallbacks."""
    ctx = w.ctx
    ix, part = ctx.args.stats.index, ctx.part
    compute, wait, inputs = w.state.clock.take()
    backward_passes = w.state.take_backward_passes()
    if ctx.group_rank == 0:
        stats[ix[f"{part}_sq"]] = sq
        stats[ix[f"{part}_time"]] = compute
        stats[ix[f"{part}_wait"]] = wait
        stats[ix[f"{part}_inputs"]] = inputs
        stats[ix[f"{part}_peak"]] = memory.peak_memory_mb(ctx.device)
        memory.reset_peak_memory(ctx.device)  # the next step's peak: from here
        stats[ix[f"{part}_inflight"]] = inflight
        stats[ix[f"{part}_bwd"]] = backward_passes
    stats[ix[f"{part}_peak_flops"]] = math.nan if ctx.peak_flops is None else ctx.peak_flops
    stats[ix["transfer_fallbacks"]] = ctx.channel.take_fallbacks()
    stats[ix["checkpoint_writing"]] = checkpoint.writing(w.writer)


def placement_metrics(ctx: WorkerContext, fallbacks: int) -> dict:
    """``transfer_tier``: the tiers that carried tensors between the groups this step
    (e.g. "shm", "cuda_ipc+nccl"; "gloo" joins when messages fell back to it);
    ``<group>_restarts``: how often that group alone was restarted in this attempt;
    ``<group>_standby_takeovers``: how many of those restarts its standby took (a group
    with ``standby=True``); ``<group>_workers``: its current number of workers (an
    elastic group's size); with
    ``report_placement`` also ``placement``: each worker's ``[placement group id, bundle
    index]`` as the worker saw it."""
    spec = ctx.channel.spec
    tiers = set(spec.tiers.values()) | ({"gloo"} if fallbacks else set())
    out = {"transfer_tier": "+".join(sorted(tiers)) or "none"}
    out.update({f"{g}_restarts": spec.restarts.get(g, 0) for g in ctx.args.groups})
    out.update({f"{g}_standby_takeovers": n for g, n in spec.takeovers.items()})
    out.update({f"{g}_workers": spec.sizes[g] for g in ctx.args.groups})
    if ctx.cfg.report_placement:
        out["placement"] = {
            spec.label(r): [loc.placement_group, loc.bundle] for r, loc in enumerate(spec.locations)
        }
    return out
