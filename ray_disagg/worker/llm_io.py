"""The LLM group's transfers of a step: the encoder fields of its samples out, the
crossing tensors (encoder outputs) in, in its samples' order, shared over the replica's
model-parallel ranks, and their gradients back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_disagg.pipeline.messages import Crossings, Grads, Inputs, StepKey, expect
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.objective import REF
from ray_disagg.worker.state import WorkerState

__all__ = ["receive_crossings", "send_grads", "send_inputs", "share", "sum_over_cp"]


def send_inputs(
    ctx: WorkerContext, state: WorkerState, samples: dict, mbs, plan, key: StepKey, plan_step, refs
):
    """One message per encoder replica it shares samples with: per microbatch, the
    encoder fields of those samples, or with ``refs`` (map-style data) their
    :class:`~ray_disagg.pipeline.messages.SampleRef` s (so encoders can run ahead)."""
    adapter, mine = ctx.adapter, [set(mb[ctx.part][ctx.dp_rank]) for mb in mbs]
    for part in adapter.encoder_parts:
        keys = ("id", *adapter.encoder_fields(part))

        def fields(p, keys=keys):
            return refs[p] if refs else {k: samples[p][k] for k in keys if k in samples[p]}

        for d in plan.peers(ctx.part, ctx.dp_rank, part, plan_step, mbs):
            per_mb = [[fields(p) for p in mb[part][d] if p in m] for mb, m in zip(mbs, mine)]
            msg = Inputs(key=key, microbatches=per_mb)
            state.post(ctx.channel.send_tensors(ctx.side_rank(part, d), {}, msg, False))


def receive_crossings(ctx: WorkerContext, plan, key: StepKey, j: int, mb, samples: dict):
    """``{crossing: rows of this replica's microbatch, in its samples' order}`` (float32;
    a trained encoder's reference outputs under ``REF`` names), per encoder replica it
    heard from the positions, dtypes and every sample's crossing rows (for the
    gradients), and ``{crossing: rows of each of its samples}``."""
    adapter, mine = ctx.adapter, mb[ctx.part][ctx.dp_rank]
    pieces, routes, own, rows_by_part = {}, [], set(mine), {}
    for part in adapter.encoder_parts:
        part_rows = None  # {position: {crossing: rows}} of this replica's samples
        for d in range(plan.dp_sizes[part]):
            positions = [p for p in mb[part][d] if p in own]
            if not positions:
                continue
            src = ctx.side_rank(part, d)
            msg, tensors = ctx.channel.recv_tensors(src, ctx.device)
            expect(msg, Crossings, key, j, receiver="LLM group")
            if part_rows is None:
                part_rows = rows_by_part[part] = {
                    p: adapter.crossing_rows(part, samples[p]) for p in mine
                }
            for name, t in tensors.items():
                sizes = [part_rows[p][name.removeprefix(REF)] for p in positions]
                for p, piece in zip(positions, t.split(sizes)):
                    pieces[(name, p)] = piece
            if part not in ctx.args.frozen_parts:  # a frozen encoder gets no gradients
                dtypes = {n: t.dtype for n, t in tensors.items() if not n.startswith(REF)}
                routes.append((src, positions, dtypes, part_rows))
    received, rows = {}, {}
    for part in adapter.encoder_parts:
        for c in adapter.crossings(part):
            for name in (c.name, REF + c.name):
                parts = [pieces[(name, p)] for p in mine if (name, p) in pieces]
                if parts:  # the loss runs in float32 (autocast inside), as single-process
                    received[name] = (parts[0] if len(parts) == 1 else torch.cat(parts)).float()
                    rows[name] = [rows_by_part[part][p][c.name] for p in mine]
    return received, routes, rows


def send_grads(
    ctx: WorkerContext, state: WorkerState, received: dict, routes, mb, key: StepKey, j: int
) -> None:
    """Each encoder replica gets the gradients of the rows it sent (split once per
    crossing, with the rows ``_receive_crossings`` computed)."""
    mine, by_pos = mb[ctx.part][ctx.dp_rank], {}
    for dst, positions, dtypes, part_rows in routes:
        grads = {}
        for name in dtypes:
            if name not in by_pos:
                g = received[name].grad
                g = torch.zeros_like(received[name]) if g is None else g
                by_pos[name] = dict(zip(mine, g.split([part_rows[p][name] for p in mine])))
            grads[name] = torch.cat([by_pos[name][p] for p in positions]).to(dtypes[name])
        state.post(ctx.channel.send_tensors(dst, grads, Grads(key=key, mb=j), False))


def sum_over_cp(ctx: WorkerContext, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        dist.all_reduce(t, group=ctx.cp_mesh.get_group())


def share(ctx: WorkerContext, received: dict, rows: dict):
    """The leader's crossing tensors and their rows per sample on every rank of its
    replica (tp, cp)."""
    meta = ({k: tuple(v.shape) for k, v in received.items()}, rows) if ctx.leader else None
    shapes, rows = ctx.broadcast_object(meta)
    received = {k: v.to(ctx.device) for k, v in received.items()}
    if ctx.mp_size > 1:
        if not ctx.leader:
            received = {k: torch.empty(s, device=ctx.device) for k, s in shapes.items()}
        for k in sorted(received):
            dist.broadcast(received[k], src=ctx.mp_src, group=ctx.mp_mesh.get_group())
    return received, rows
