"""The LLM group's step, top to bottom: :func:`train_step` runs its phases in order.

1. **Read inputs** (``SEND_INPUTS``): LLM data-parallel replica ``t``'s leader (its tp
   rank 0) reads its share of the global batch (``BatchPlan.assign``), sends every encoder
   replica the encoder fields of the samples it will encode, for every microbatch, and
   shares the text fields with its tp ranks; the global batch's samples, sequences and
   label tokens are all-reduced (an objective's step begins with them).
2. **Exchange, forward and backward per action** (``llm_actions``): microbatch by
   microbatch it receives the crossing tensors (image/video/audio embeddings, DeepStack
   features) of its samples from the encoder replicas (``RECV_CROSSINGS``), puts them in
   its samples' order and shares them with its tp peers, computes the loss through the
   adapter (HF's own merge and rope; normalised by the global batch's label tokens) and
   runs backward (``TRAIN``), and posts the crossings' gradients back (``SEND_GRADS``).
3. **Measure**: the step's stats slots (the loss read once the step's last gradients
   are posted), sample ids, a stream's position, expert load.
4. **Reduce, exchange the stats, apply, report and save**
   (:mod:`ray_disagg.worker.step_end`).

Gradients accumulate over the microbatches; the optimizer steps once. With group
recovery (``worker/recovery.py``) every transfer is guarded and every rank agrees at
fixed points whether the step goes on.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ray_disagg.pipeline.messages import Crossings, Grads, Inputs, StepKey, expect
from ray_disagg.pipeline.schedule import WAITS, Op
from ray_disagg.worker import faults_hook, ingest, recovery, step_end
from ray_disagg.worker.checkpoint import record_data_position
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.llm_batch import LLMModel
from ray_disagg.worker.metrics import label_tokens_by_source, sample_ids, step_stats
from ray_disagg.worker.objective import REF
from ray_disagg.worker.part_worker import PartWorker
from ray_disagg.worker.state import WorkerState

__all__ = ["LLMStep", "train_step"]


def train_step(
    w: PartWorker, llm: LLMModel, source, step: int, actions, evaluate, rollouts=None
) -> None:
    """One training step of the LLM group (``actions``: its ``llm_actions``;
    ``evaluate``: the validation pass, run on evaluation steps; ``rollouts``: GRPO's
    generation (``worker/rollout.py``), which a generating step begins with)."""
    ctx = w.ctx
    faults_hook.drill(ctx.part, ctx.group_rank, step)
    w.state.clock.begin(step, ctx.cfg.trace_steps)
    rollout = None if rollouts is None else rollouts.before_update(source, step)
    t0 = time.perf_counter()
    run = LLMStep(llm, source, ctx.args.plan, step, StepKey(step), grad=True, rollout=rollout)
    run.run(actions)  # read inputs, exchange, forward and backward per action
    stats, ids, extra = run.measure()
    if rollouts is not None:  # GRPO: the rollout's, the rewards' and the update's seconds
        extra.update(rollouts.times, train_s=time.perf_counter() - t0)
    sq = step_end.reduce(w)
    stats = step_end.exchange(w, step, stats, sq)
    step_end.apply(w, step, stats, ids)
    step_end.report(w, step, stats, evaluate, extra)  # and save at checkpoint steps


class LLMStep:
    """Executes one step's LLM actions (a training step, or with ``grad=False`` a
    validation batch: forward only, unnormalised loss sums)."""

    def __init__(
        self, llm: LLMModel, source, plan, plan_step: int, key: StepKey, grad: bool, rollout=None
    ):
        self.w: PartWorker = llm.w
        self.llm, self.source, self.plan, self.rollout = llm, source, plan, rollout
        self.plan_step, self.key, self.grad = plan_step, key, grad
        self.mbs = plan.assign(plan_step)
        self.samples, self.items, self.local_labels, self.n_labels = {}, {}, 0, 1.0
        self.received = {}  # microbatch -> (its crossings, their routes back, rows)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.w.ctx.device)
        self.tokens, self.flops = 0, 0.0
        n = len(self.w.ctx.args.sources) if grad else 0  # a mixture's per-source loss sums
        self.by_source = torch.zeros(n, device=self.w.ctx.device) if n else None
        self.source_labels = [0] * n
        if grad and llm.objective is not None:
            llm.objective.reset()

    def run(self, actions) -> None:
        handlers = {
            Op.SEND_INPUTS: self.send_inputs,
            Op.RECV_CROSSINGS: self.recv_crossings,
            Op.WAIT_SENDS: self.wait_sends,
            Op.TRAIN: self.train,
            Op.SEND_GRADS: self.send_grads,
        }
        for action in actions:
            with self.w.state.clock.span(waiting=action.op in WAITS, action=action):
                handlers[action.op](action.mb)
        recovery.agree(self.w)  # the step's last transfers went through on every rank
        if self.w.ctx.is_cp:  # the replica's loss: the sum of its ranks' slices
            sums = [self.loss_sum] + ([self.by_source] if self.by_source is not None else [])
            _sum_over_cp(self.w.ctx, sums)

    def wait_sends(self, _mb=None) -> None:
        recovery.guarded(self.w, self.w.state.wait_pending)

    def send_inputs(self, _mb) -> None:
        """Read the replica's samples (leader), send the encoders theirs, share the LLM
        items over tp, and (training) count the global batch's label tokens."""
        w, rollout = self.w, self.rollout
        ctx = w.ctx
        share, read = self._read()
        if ctx.leader:
            if rollout is not None:  # GRPO: the prompts with their completions
                read = [{**s, **rollout.fields[p]} for p, s in zip(share, read)]
            self.samples = dict(zip(share, read))
            refs = None  # map-style: the encoders read their fields themselves
            if isinstance(self.source, ingest.MapStyleSource):
                refs = self.source.refs(self.plan_step, share)
            skip = rollout.parts if rollout is not None else ()
            args = (ctx, w.state, self.samples, self.mbs, self.plan, self.key, self.plan_step,
                    refs, skip)  # fmt: skip
            recovery.guarded(w, _send_inputs, *args)
        keys = self.llm.text_keys
        items = {p: {k: s[k] for k in keys if k in s} for p, s in self.samples.items()}
        self.items = ctx.broadcast_object(items)
        sequences = len(self.items)
        if self.by_source is not None:  # a mixture (token loss): counted per source
            self.source_labels = label_tokens_by_source(ctx, self.items.values())
            self.local_labels = sum(self.source_labels)
        else:
            sequences, self.local_labels = self.llm.counts(self.items.values())
        if self.grad:  # the global batch's samples, sequences and label tokens
            local = [0, 0, 0]  # each replica's leader counts it (over gloo: no device sync)
            if ctx.leader:
                local = [len(self.items), sequences, self.local_labels]
            n = torch.tensor(local, dtype=torch.float64)
            dist.all_reduce(n, group=ctx.rt.object_group)
            totals = tuple(max(float(v), 1.0) for v in n)
            self.n_labels = totals[2]  # the token loss's normaliser
            if self.llm.objective is not None:
                self.llm.objective.begin_step(self.plan_step, self.items, totals)

    def _read(self) -> tuple[list[int], list[dict]]:
        """``(the replica's batch positions, its samples (leader))``: read, or as the
        step's rollout read them (its microbatches too)."""
        ctx, rollout = self.w.ctx, self.rollout
        if rollout is not None and rollout.samples is not None:
            self.mbs = rollout.mbs
            share = [p for mb in self.mbs for p in mb[ctx.part][ctx.dp_rank]]
            return share, [rollout.samples[p] for p in share] if ctx.leader else []
        share = [p for mb in self.mbs for p in mb[ctx.part][ctx.dp_rank]]
        with self.w.state.clock.awaiting_inputs():  # the step's data wait
            read = ingest.read_samples(self.source, self.plan_step, share, ctx.args)
        if self.plan.streamed_costs:  # a balanced stream: split by this step's costs
            self.mbs = self.plan.assign(self.plan_step, self.source.step_costs)
            share = [p for mb in self.mbs for p in mb[ctx.part][ctx.dp_rank]]  # known now
        return share, read

    def recv_crossings(self, j: int) -> None:
        w = self.w
        ctx = w.ctx
        if self.grad:
            faults_hook.drill(ctx.part, ctx.group_rank, self.key.step, j)
        got = (None, None, None)
        if ctx.leader:
            args = (ctx, self.plan, self.key, j, self.mbs[j], self.samples, self.rollout)
            got = recovery.guarded(w, _receive_crossings, *args, default=got)
        self.received[j] = (got[0] or {}, got[1] or [], got[2] or {})

    def train(self, j: int) -> None:
        """Forward and backward of microbatch ``j`` (forward only when not ``grad``)."""
        w, mb = self.w, self.mbs[j]
        ctx = w.ctx
        recovery.agree(w)  # every rank has its crossings, or the step is abandoned
        received, routes, rows = self.received[j]
        with torch.set_grad_enabled(self.grad):
            shared, rows = share_crossings(ctx, received, rows)
            names = self.llm.grad_names if self.grad else ()
            received = {n: v.requires_grad_(n in names) for n, v in shared.items()}
            loss = self.llm.loss(
                self.items, mb, received, rows, self.n_labels, self.grad, self.by_source
            )
        sends = self.grad and ctx.leader and self.llm.grad_names  # kept for SEND_GRADS
        kept = {k: v for k, v in received.items() if not k.startswith(REF)}
        self.received[j] = (kept, routes, rows) if sends else None
        if loss.requires_grad:  # not: a frozen LLM with nothing trainable upstream
            loss.backward()
            w.state.count_backward()
            if ctx.is_cp:  # each cp rank has its slice's part of the crossings' gradients
                grads = [v.grad for v in received.values() if v.grad is not None]
                _sum_over_cp(ctx, grads)
        reported = loss if self.llm.objective is None else self.llm.objective.reported
        self.loss_sum += reported.detach().to(torch.float64)
        mine = [self.items[p] for p in mb[ctx.part][ctx.dp_rank]]
        self.tokens += self.llm.tokens(mine)
        if ctx.leader:  # its stats slot's only writer
            self.flops += self.llm.flops(mine, backward=loss.requires_grad)

    def send_grads(self, j: int) -> None:
        w = self.w
        if w.ctx.leader:
            received, routes = self.received[j][:2]
            args = (w.ctx, w.state, received, routes, self.mbs[j], self.key, j)
            recovery.guarded(w, _send_grads, *args)
        self.received[j] = None

    def ordered_items(self) -> list[dict]:
        return [self.items[p] for p in sorted(self.items)]

    def measure(self):
        """``(the step's stats slots, this rank's sample ids, metrics)``: the loss and
        counts (read once the step's last gradients were posted), every replica's sample
        ids (``report_sample_ids``), a stream's position (into the checkpoint at
        checkpoint steps), a mixture's epochs, the experts' load."""
        w, llm = self.w, self.llm
        ctx = w.ctx
        ids, extra = sample_ids(ctx, self)
        step = self.plan_step  # a training step's
        extra.update(record_data_position(ctx.cfg, w.writer, self.source, step))
        extra.update(ingest.mixture_epochs(self.source, step))
        extra.update(llm.expert_load())
        stats = step_stats(ctx, self, llm.objective and llm.objective.take_metrics())
        return stats, ids, extra


def _send_inputs(
    ctx: WorkerContext, state: WorkerState, samples: dict, mbs, plan, key: StepKey, plan_step,
    refs, skip=(),
):  # fmt: skip
    """One message per encoder replica it shares samples with: per microbatch, the
    encoder fields of those samples, or with ``refs`` (map-style data) their
    :class:`~ray_disagg.pipeline.messages.SampleRef` s (so encoders can run ahead);
    none to the parts in ``skip`` (their rows came with the step's rollout)."""
    adapter, mine = ctx.adapter, [set(mb[ctx.part][ctx.dp_rank]) for mb in mbs]
    for part in adapter.encoder_parts:
        if part in skip:
            continue
        keys = ("id", *adapter.encoder_fields(part))

        def fields(p, keys=keys):
            return refs[p] if refs else {k: samples[p][k] for k in keys if k in samples[p]}

        for d in plan.peers(ctx.part, ctx.dp_rank, part, plan_step, mbs):
            per_mb = [[fields(p) for p in mb[part][d] if p in m] for mb, m in zip(mbs, mine)]
            msg = Inputs(key=key, microbatches=per_mb)
            state.post(ctx.channel.send_tensors(ctx.side_rank(part, d), {}, msg, False))


def _receive_crossings(
    ctx: WorkerContext, plan, key: StepKey, j: int, mb, samples: dict, rollout=None
):
    """``{crossing: rows of this replica's microbatch, in its samples' order}`` (float32;
    a trained encoder's reference outputs under ``REF`` names), per encoder replica it
    heard from the positions, dtypes and every sample's crossing rows (for the
    gradients), and ``{crossing: rows of each of its samples}``. The rows of the parts
    the step's ``rollout`` kept come from it (a frozen tower encodes once per step)."""
    adapter, mine = ctx.adapter, mb[ctx.part][ctx.dp_rank]
    pieces, routes, own, rows_by_part = {}, [], set(mine), {}
    for part in adapter.encoder_parts:
        if rollout is not None and part in rollout.parts:
            rows_by_part[part] = {p: adapter.crossing_rows(part, samples[p]) for p in mine}
            pieces.update({k: v for k, v in rollout.rows.items() if k[1] in own})
            continue
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


def _send_grads(
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


def _sum_over_cp(ctx: WorkerContext, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        dist.all_reduce(t, group=ctx.cp_mesh.get_group())


def share_crossings(ctx: WorkerContext, received: dict, rows: dict):
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
