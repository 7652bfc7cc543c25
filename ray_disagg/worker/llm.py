"""The worker loop of the LLM group: it executes the LLM side of each step's schedule
(``ray_disagg.pipeline.schedule.llm_actions``).

LLM data-parallel replica ``t`` (its tp rank 0) is where samples are read: at the start
of a step it reads its share of the global batch (``BatchPlan.assign``) and sends every
encoder replica the encoder fields of the samples it will encode, for every microbatch.
Then, microbatch by microbatch, it receives the crossing tensors (image/video/audio
embeddings, DeepStack features) of its samples from the encoder replicas, puts them in
its samples' order, shares them with its tp peers, computes the loss through the adapter
(HF's own merge and rope; normalised by the global batch's label tokens), runs backward
and posts the crossings' gradients back. The loss value is read once the step's last
gradients are posted. Gradients accumulate over the microbatches; the optimizer steps once.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from ray_disagg.data.mixture import SOURCE_KEY, Mixture
from ray_disagg.models import moe
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.pipeline.messages import StepKey
from ray_disagg.pipeline.schedule import WAITS, Op, llm_actions
from ray_disagg.worker import faults_hook, ingest, llm_batch, llm_io, mfu, recovery
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.checkpoint import record_data_position
from ray_disagg.worker.console import log_line
from ray_disagg.worker.metrics import (
    label_tokens_by_source,
    plain,
    sample_ids,
    source_index,
    step_stats,
)
from ray_disagg.worker.objective import REF, ObjectiveRunner
from ray_disagg.worker.part_worker import PartModel, PartWorker
from ray_disagg.worker.session import get_session
from ray_disagg.worker.step import finish_step


class LLMModel:
    """The pieces of one LLM worker that training and validation share."""

    def __init__(self, w: PartWorker, model, lm_head, tp_group, vocab_start, objective=None):
        self.w, self.model, self.lm_head = w, model, lm_head
        self.tp_group, self.vocab_start = tp_group, vocab_start
        ctx, adapter = w.ctx, w.ctx.adapter
        load = moe.ExpertLoad(adapter.llm_modules(model)[0])  # hooks on MoE routers only
        self.load = load if load.routers else None
        self.objective = objective  # an ObjectiveRunner, or None: the token loss (SFT)
        self.policy = PartModel(model=model, runner=w.runner, parallel=w.parallel)
        if objective is not None:
            objective.load = self.load
        obj = ctx.cfg.objective
        keys = ("input_ids", "labels") if obj is None else (*obj.sequence_keys, *obj.fields)
        keys += (SOURCE_KEY,) if ctx.args.sources else ()  # a mixture's per-source metrics
        self.text_keys = ("id", *keys, *adapter.llm_fields())
        self.grad_names = {  # crossings whose encoder has something to train
            c.name
            for part in adapter.encoder_parts
            if part not in ctx.args.frozen_parts
            for c in adapter.crossings(part)
        }

    def label_tokens(self, items) -> int:
        if self.objective is not None:
            return self.objective.label_tokens(list(items))
        return sum(count_label_tokens(self.w.ctx.adapter.labels(it)) for it in items)

    def tokens(self, items) -> int:
        seqs = items if self.objective is None else self.objective.sequences(items)[0]
        return sum(len(q["input_ids"]) for q in seqs)

    def flops(self, items, backward: bool) -> float:
        """Model FLOPs of ``items``' sequences (an objective's reference pass not counted;
        a frozen LLM's backward: input gradients only)."""
        seqs = items if self.objective is None else self.objective.sequences(items)[0]
        ctx = self.w.ctx
        return mfu.samples_flops(ctx.adapter, ctx.part, seqs, backward, trains=not ctx.frozen)

    def loss(self, items, mb, received, rows, n_labels, grad: bool, by_source=None):
        """The microbatch's loss: the token loss over ``n_labels`` (the global batch's
        label tokens), or the objective's (``n_labels``: the global batch's samples);
        ``by_source``: a mixture's per-source sums of the token loss, added to."""
        ctx = self.w.ctx
        if self.load is not None:  # count this forward's routing (not recomputations)
            self.load.active = grad
        try:
            if self.objective is not None:
                samples = [items[p] for p in mb[ctx.part][ctx.dp_rank]]
                return self.objective.loss(self.policy, samples, received, rows, n_labels, grad)
            return self._token_loss(items, mb, received, n_labels, grad, by_source)
        finally:
            if self.load is not None:
                self.load.active = False

    def _token_loss(self, items, mb, received, n_labels, grad: bool, by_source=None):
        ctx = self.w.ctx
        mine = [items[p] for p in mb[ctx.part][ctx.dp_rank]]
        batch = llm_batch.collate(ctx, mine, sequences=by_source is not None)
        if grad and ctx.adapter.router is not None:  # validation reports the token loss
            batch["router"] = ctx.token_group
        inputs = llm_batch.LossInputs(
            adapter=ctx.adapter,
            lm_head=self.lm_head,
            batch=batch,
            received=received,
            normalizer=n_labels,
            tp_group=self.tp_group,
            vocab_start=self.vocab_start,
            chunk_tokens=ctx.cfg.loss_chunk_tokens,
            context=batch.pop("context", None),
        )
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=ctx.cfg.bf16):
            total, per_sequence = self.w.runner(functools.partial(llm_batch.loss, inputs))
        if by_source is not None:
            index = source_index(mine, ctx.args.sources, ctx.device)
            by_source.index_add_(0, index, per_sequence)
        return total

    def expert_load(self) -> dict[str, float]:
        """The step's ``<part>_expert_load_max`` / ``_mean`` over the global batch (MoE;
        collective over the ranks holding different tokens)."""
        if self.load is None:
            return {}
        ctx = self.w.ctx
        load = self.load.take(ctx.token_group, ctx.device)
        return {f"{ctx.part}_{k}": v for k, v in load.items()}


class LLMStep:
    """Executes one step's LLM actions (a training step, or with ``grad=False`` a
    validation batch: forward only, unnormalised loss sums)."""

    def __init__(self, llm: LLMModel, source, plan, plan_step: int, key: StepKey, grad: bool):
        self.w: PartWorker = llm.w
        self.llm, self.source, self.plan = llm, source, plan
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
            llm_io.sum_over_cp(self.w.ctx, sums)

    def wait_sends(self, _mb=None) -> None:
        recovery.guarded(self.w, self.w.state.wait_pending)

    def send_inputs(self, _mb) -> None:
        """Read the replica's samples (leader), send the encoders theirs, share the LLM
        items over tp, and (training) count the global batch's label tokens."""
        w, mbs = self.w, self.mbs
        ctx = w.ctx
        share = [p for mb in mbs for p in mb[ctx.part][ctx.dp_rank]]
        read = ingest.read_samples(self.source, self.plan_step, share, ctx.args)
        if self.plan.streamed_costs:  # a balanced stream: split by this step's costs
            self.mbs = mbs = self.plan.assign(self.plan_step, self.source.step_costs)
            share = [p for mb in mbs for p in mb[ctx.part][ctx.dp_rank]]  # a budget's: known now
        if ctx.leader:
            self.samples = dict(zip(share, read))
            refs = None  # map-style: the encoders read their fields themselves
            if isinstance(self.source, ingest.MapStyleSource):
                refs = self.source.refs(self.plan_step, share)
            args = (ctx, w.state, self.samples, mbs, self.plan, self.key, self.plan_step, refs)
            recovery.guarded(w, llm_io.send_inputs, *args)
        keys = self.llm.text_keys
        items = {p: {k: s[k] for k in keys if k in s} for p, s in self.samples.items()}
        self.items = ctx.broadcast_object(items)
        if self.by_source is not None:  # a mixture (token loss): counted per source
            self.source_labels = label_tokens_by_source(ctx, self.items.values())
            self.local_labels = sum(self.source_labels)
        else:
            self.local_labels = self.llm.label_tokens(self.items.values())
        if self.grad:  # the loss's normaliser: label tokens, or an objective's samples
            local = self.local_labels if self.llm.objective is None else len(self.items)
            n = torch.tensor([local], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(n, group=ctx.dp_mesh.get_group())
            self.n_labels = max(float(n), 1.0)

    def recv_crossings(self, j: int) -> None:
        w = self.w
        ctx = w.ctx
        if self.grad:
            faults_hook.drill(ctx.part, ctx.group_rank, self.key.step, j)
        got = (None, None, None)
        if ctx.leader:
            args = (ctx, self.plan, self.key, j, self.mbs[j], self.samples)
            got = recovery.guarded(w, llm_io.receive_crossings, *args, default=got)
        self.received[j] = (got[0] or {}, got[1] or [], got[2] or {})

    def train(self, j: int) -> None:
        """Forward and backward of microbatch ``j`` (forward only when not ``grad``)."""
        w, mb = self.w, self.mbs[j]
        ctx = w.ctx
        recovery.agree(w)  # every rank has its crossings, or the step is abandoned
        received, routes, rows = self.received[j]
        with torch.set_grad_enabled(self.grad):
            shared, rows = llm_io.share(ctx, received, rows)
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
                llm_io.sum_over_cp(ctx, grads)
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
            recovery.guarded(w, llm_io.send_grads, *args)
        self.received[j] = None

    def ordered_items(self) -> list[dict]:
        return [self.items[p] for p in sorted(self.items)]


def _forward_all(llm: LLMModel, source, plan, step: int):
    """Forward only, every batch of ``plan`` (keys ``StepKey(step, batch)``): each
    batch's executed :class:`LLMStep`."""
    actions = llm_actions(plan.micro_batches, 1, sends_grads=False)
    for v in range(plan.steps_per_epoch):
        run = LLMStep(llm, source, plan, v, StepKey(step, v), grad=False)
        run.run(actions)
        yield run


def _evaluate(llm: LLMModel, source, step: int) -> list[float]:
    """This rank's ``[summed token loss, label tokens]`` over the validation set
    (non-zero on replica leaders only), forward only."""
    loss_sum, n_labels, plan = 0.0, 0, llm.w.ctx.args.val_plan  # at the groups' current sizes
    for run in _forward_all(llm, source, plan, step):
        loss_sum += float(run.loss_sum)
        n_labels += run.local_labels
    return [loss_sum, n_labels] if llm.w.ctx.leader else [0.0, 0.0]


def _precompute(w: PartWorker, llm: LLMModel, data, start: int) -> None:
    """The reference's log-probs of every training sample (``DPO(reference=
    "precompute")``): from the checkpoint the run resumes from, else one forward-only
    pass with the initial weights before the first step (the encoder groups run theirs);
    kept on every LLM rank and saved with every checkpoint."""
    ctx = w.ctx
    runner, ids = llm.objective, _sample_ids(data)
    if w.writer.reference_logps is not None:  # restored with the checkpoint
        runner.load_table(w.writer.reference_logps, ids)
        return
    restarts = ctx.channel.spec.restarts.get(ctx.part, 0)
    if not ctx.args.runs_reference_pass(start, restarts):
        raise ValueError(
            f"the checkpoint this run resumes from (step {start}) holds no precomputed "
            "reference log-probs (a run with DPO(reference='precompute') saves them); "
            "resume with reference='copy', or start a new run."
        )
    plan, t0 = ctx.args.reference_plan, time.perf_counter()
    source = ingest.MapStyleSource(data, plan, ctx.part) if ctx.leader else None
    runner.start_recording()
    for _ in _forward_all(llm, source, plan, -1):
        pass
    w.writer.keep_reference_logps(runner.finish_recording())
    runner.load_table(w.writer.reference_logps, ids)
    w.state.restart_clock()  # the pass is not the first step's time
    if ctx.group_rank == 0:
        n, dt = len(runner.table), time.perf_counter() - t0
        log_line(f"{ctx.part}: reference log-probs of {n} samples computed in {dt:.1f}s")


def _sample_ids(data) -> set:
    """The ``id`` of every sample of a map-style training set (a column when it has one)."""
    if "id" in (getattr(data, "column_names", None) or ()):
        return {plain(i) for i in data["id"]}
    return {plain(data[i].get("id")) for i in range(len(data))}


def llm_train_loop(args: LoopArgs) -> None:
    w = PartWorker(args, args.adapter.llm_part)
    model = w.build()
    start = w.setup(model)  # the plans (parallelize_part), FSDP2, weights, optimizer
    ctx, cfg = w.ctx, args.cfg  # the context until a group restart replaces it
    data = get_session().fetch(args.dataset_ref[0])
    if isinstance(data, Mixture):  # saved with each checkpoint: a resume must match it
        w.writer.keep_mixture(data.fingerprint())
    group = ctx.rt.object_group
    source = ingest.make_source(
        data, args.plan, ctx.dp_rank, ctx.leader, ctx.part, group, w.data_state
    )
    par = w.parallel
    objective = None
    if cfg.objective is not None:
        objective = ObjectiveRunner(w, w.build_reference())
    llm = LLMModel(w, model, par.lm_head, par.tp_group, par.vocab_start, objective)
    if objective is not None and cfg.objective.reference == "precompute":
        _precompute(w, llm, data, start)
    evaluate = None
    if args.val_plan is not None:
        val_data = get_session().fetch(args.val_ref[0])
        val = ingest.MapStyleSource(val_data, args.val_plan, ctx.part, split="validation")
        evaluate = functools.partial(_evaluate, llm, val)
    limit = cfg.max_in_flight or 1
    actions = llm_actions(cfg.micro_batches, limit, sends_grads=bool(llm.grad_names))
    step = start
    while step < cfg.max_steps:
        try:
            _train_step(w, llm, source, step, actions, evaluate)
        except recovery.GroupFailed:  # an encoder group restarts; this group waits
            step = recovery.recover(w, model)
            if llm.load is not None:  # the abandoned step's routing is not counted
                llm.load.reset()
            continue
        step += 1


def _train_step(w: PartWorker, llm: LLMModel, source, step: int, actions, evaluate) -> None:
    ctx = w.ctx
    faults_hook.drill(ctx.part, ctx.group_rank, step)
    w.state.clock.begin(step, ctx.cfg.trace_steps)
    run = LLMStep(llm, source, ctx.args.plan, step, StepKey(step), grad=True)
    run.run(actions)
    ids, extra = sample_ids(ctx, run)
    extra.update(record_data_position(ctx.cfg, w.writer, source, step))
    extra.update(ingest.mixture_epochs(source, step))
    extra.update(llm.expert_load())
    stats = step_stats(ctx, run, llm.objective and llm.objective.take_metrics())
    finish_step(w, step, stats, sample_ids=ids, evaluate=evaluate, extra=extra)
