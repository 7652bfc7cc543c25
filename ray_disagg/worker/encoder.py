"""An encoder group's worker (vision, audio, ...): its loop and its step, top to bottom
(:func:`train_step`).

1. **Receive inputs** (``RECV_INPUTS``): encoder replica ``d``'s leader (its
   model-parallel rank 0) receives, from every LLM replica, the encoder fields of the
   samples it encodes in each microbatch (``BatchPlan.assign``; for map-style data only
   their indices, and every rank reads the fields from the dataset itself) and shares
   them with its SP/TP peers.
2. **Forward, exchange and backward per action** (``encoder_actions``): each forward
   posts the microbatch's crossing tensors to the LLM replicas that hold its samples
   (``FORWARD``); each backward takes their gradients (``RECV_GRADS``, ``BACKWARD``).
3. **Measure**: the items encoded and their FLOPs.
4. **Reduce, exchange the stats, apply, report and save**
   (:mod:`ray_disagg.worker.step_end`).

Gradients accumulate over the microbatches; the optimizer steps once.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ray_disagg.parallel import fsdp
from ray_disagg.pipeline.messages import Crossings, Grads, Inputs, StepKey, expect
from ray_disagg.pipeline.schedule import WAITS, Op, encoder_actions, peak_in_flight
from ray_disagg.worker import faults_hook, ingest, mfu, step_end
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.objective import REF
from ray_disagg.worker.part_worker import PartWorker


def train_step(w: PartWorker, data, step: int, actions, reference=None, evaluate=None) -> None:
    """One training step of an encoder group (``actions``: its ``encoder_actions``;
    ``reference``: an objective's frozen copy of the tower; ``evaluate``: the validation
    pass, run on evaluation steps)."""
    ctx = w.ctx
    faults_hook.drill(ctx.part, ctx.group_rank, step)
    w.state.clock.begin(step, ctx.cfg.trace_steps)
    plan, grad = ctx.args.plan, not ctx.frozen
    run = None
    if ctx.args.generates(step):  # GRPO's rollout first: the prompts' media, once
        run = EncoderStep(w, data, plan, step, StepKey(step, rollout=True), grad=False)
        training = w.model.training
        w.model.eval()  # as the LLM generates: no dropout
        try:
            run.run(encoder_actions(ctx.cfg.micro_batches, trains=False))
        finally:
            w.model.train(training)
    if run is None or grad:  # a frozen tower's rollout rows serve the update too
        rollout = run
        run = EncoderStep(w, data, plan, step, StepKey(step), grad=grad, reference=reference)
        run.run(actions)  # receive inputs, forward, exchange and backward per action
        if rollout is not None:  # the step's encoded items and FLOPs: both passes'
            run.add(rollout)
    stats = run.measure()
    sq = step_end.reduce(w)
    stats = step_end.exchange(w, step, stats, sq, inflight=peak_in_flight(actions))
    step_end.apply(w, step, stats, run.sample_ids())
    step_end.report(w, step, stats, evaluate)  # and save at checkpoint steps


def _row_offsets(adapter, part, samples) -> dict[str, list[int]]:
    """Per crossing, the first row of each sample (and the end)."""
    rows = [adapter.crossing_rows(part, s) for s in samples]
    out = {}
    for c in adapter.crossings(part):
        counts = [r[c.name] for r in rows]
        out[c.name] = [sum(counts[:k]) for k in range(len(counts) + 1)]
    return out


def _encode(w: PartWorker, samples, run=None) -> dict:
    """The part's crossings for ``samples`` (one FSDP2 root call through ``run``, by
    default the trained part's runner)."""
    ctx = w.ctx
    sp = ctx.mp_mesh.get_group() if ctx.is_sp else None

    def encode(model):
        return ctx.adapter.encode(model, ctx.part, samples, ctx.device, sp=sp)

    with torch.autocast(ctx.device.type, torch.bfloat16, enabled=ctx.cfg.bf16):
        return (run or w.runner)(encode)


def _receive_inputs(ctx: WorkerContext, plan, plan_step: int, key: StepKey):
    """Per microbatch: its samples (LLM replicas in order) and ``(llm replica, count)``,
    from every LLM replica it shares samples with at ``plan_step``."""
    llm = ctx.adapter.llm_part
    mbs = [([], []) for _ in range(plan.micro_batches)]
    for t in plan.peers(ctx.part, ctx.dp_rank, llm, plan_step):
        msg, _ = ctx.channel.recv_tensors(ctx.side_rank(llm, t))
        msg = expect(msg, Inputs, key, receiver=f"{ctx.part} group")
        for (samples, routes), sub in zip(mbs, msg.microbatches):
            if sub:
                samples += sub
                routes.append((t, len(sub)))
    return mbs


class _Microbatch:
    """One microbatch between its forward and its backward: its outputs hold the graph."""

    def __init__(self, w: PartWorker, samples, routes, j: int, grad: bool, reference=None):
        ctx = w.ctx
        self.samples, self.routes, self.j = samples, routes, j
        # FSDP2: every rank must run the same units; one without inputs runs a stand-in
        self.counts = ctx.adapter.item_counts(ctx.part, samples)
        self.flops = mfu.samples_flops(ctx.adapter, ctx.part, samples, grad) if ctx.leader else 0.0
        self.real = not ctx.fsdp or sum(self.counts.values()) > 0
        inputs = samples if self.real else ctx.adapter.stand_in_samples(ctx.part)
        with torch.set_grad_enabled(grad):  # forward only: frozen group, validation
            self.outputs = _encode(w, inputs)
        if not grad:
            fsdp.end_forward_only(w.runner)
        self.ref_outputs = {}  # an objective's reference copy: its outputs go along
        if reference is not None:
            with torch.no_grad():
                self.ref_outputs = _encode(w, inputs, reference.run)
        self.offsets = _row_offsets(ctx.adapter, ctx.part, samples)
        self.grads = {c.name: [] for c in ctx.adapter.crossings(ctx.part)}

    def send(self, w: PartWorker, key: StepKey) -> None:
        """Post each LLM replica the rows of its samples (asynchronously)."""
        ctx = w.ctx
        first, llm = 0, ctx.adapter.llm_part
        for t, n in self.routes:
            tensors = {}
            for c in ctx.adapter.crossings(ctx.part):
                a, b = self.offsets[c.name][first], self.offsets[c.name][first + n]
                if b > a:
                    tensors[c.name] = self.outputs[c.name][a:b].detach()
                    if c.name in self.ref_outputs:
                        tensors[REF + c.name] = self.ref_outputs[c.name][a:b]
            first += n
            msg = Crossings(key=key, mb=self.j)
            w.state.post(ctx.channel.send_tensors(ctx.side_rank(llm, t), tensors, msg, False))

    def receive_grads(self, w: PartWorker, key: StepKey) -> None:
        ctx = w.ctx
        for t, _n in self.routes:
            src = ctx.side_rank(ctx.adapter.llm_part, t)
            msg, received = ctx.channel.recv_tensors(src, ctx.device)
            expect(msg, Grads, key, self.j, receiver=f"{ctx.part} group")
            for name, g in received.items():
                self.grads[name].append(g)

    def backward(self, w: PartWorker) -> None:
        ctx = w.ctx
        outs, out_grads = [], []
        for name, out in self.outputs.items():
            # sp: non-leaders hold an empty slice but must join the backward;
            # tp: every rank holds the replicated output and needs the full gradient
            has = ctx.leader and self.real
            grad = torch.cat(self.grads[name]).to(ctx.device) if has else torch.zeros_like(out)
            grad = grad.to(ctx.device, out.dtype)
            if ctx.is_tp:
                dist.broadcast(grad, src=ctx.mp_src, group=ctx.mp_mesh.get_group())
            outs.append(out)
            out_grads.append(grad)
        if outs:
            torch.autograd.backward(outs, out_grads)
            w.state.count_backward()
        self.outputs = self.grads = self.ref_outputs = None


class EncoderStep:
    """Executes one step's encoder actions (a training step, or a validation batch with
    ``grad=False``); ``counts`` are the items (images, videos, ...) it encoded, ``flops``
    their model FLOPs (:mod:`ray_disagg.worker.mfu`)."""

    def __init__(
        self, w: PartWorker, data, plan, plan_step: int, key: StepKey, grad: bool, reference=None
    ):
        self.w, self.data, self.plan, self.plan_step = w, data, plan, plan_step
        self.key, self.grad, self.reference = key, grad, reference
        self.inputs, self.live, self.counts, self.flops = None, {}, {}, 0.0

    def run(self, actions) -> None:
        handlers = {
            Op.RECV_INPUTS: self.recv_inputs,
            Op.FORWARD: self.forward,
            Op.RECV_GRADS: lambda j: self.live[j].receive_grads(self.w, self.key),
            Op.BACKWARD: lambda j: self.live.pop(j).backward(self.w),
            Op.WAIT_SENDS: self.w.state.wait_pending,
        }
        for action in actions:
            if action.op is Op.RECV_GRADS and not self.w.ctx.leader:
                continue
            with self.w.state.clock.span(waiting=action.op in WAITS, action=action):
                handlers[action.op](action.mb)

    def recv_inputs(self, _mb) -> None:
        w = self.w
        ctx = w.ctx
        with w.state.clock.awaiting_inputs():  # data wait while the LLM group reads them
            mbs = _receive_inputs(ctx, self.plan, self.plan_step, self.key) if ctx.leader else None
            mbs = ctx.broadcast_object(mbs)  # map-style data: SampleRefs, each rank reads its own
        keys = ("id", *ctx.adapter.encoder_fields(ctx.part))
        self.inputs = [([self.data.resolve(s, keys) for s in ss], r) for ss, r in mbs]

    def forward(self, j: int) -> None:
        w = self.w
        ctx = w.ctx
        if self.grad:
            faults_hook.drill(ctx.part, ctx.group_rank, self.key.step, j)
        samples, routes = self.inputs[j]
        mb = _Microbatch(w, samples, routes, j, self.grad, self.reference)
        if ctx.leader:
            mb.send(w, self.key)
        mb.ref_outputs = None  # posted: the transports hold what they still send
        for name, n in mb.counts.items():
            self.counts[name] = self.counts.get(name, 0) + n
        self.flops += mb.flops
        if self.grad:
            self.live[j] = mb

    def add(self, other: EncoderStep) -> None:
        """Count ``other``'s items and FLOPs too (a step's rollout pass)."""
        for name, n in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + n
        self.flops += other.flops

    def measure(self):
        """The step's stats slots of this group: the items encoded (images, videos, ...)
        and their model FLOPs, from the replica's leader."""
        ctx = self.w.ctx
        stats = ctx.args.stats.new()
        if ctx.leader:
            ix = ctx.args.stats.index
            for name, n in self.counts.items():
                stats[ix[name]] = n
            stats[ix[f"{ctx.part}_flops"]] = self.flops
        return stats

    def sample_ids(self) -> list:
        return [s.get("id") for samples, _ in self.inputs for s in samples]


def _encode_all(w: PartWorker, data, plan, step: int) -> None:
    """Forward only, every batch of ``plan`` (keys ``StepKey(step, batch)``), for the
    LLM group (which computes the loss or the log-probs)."""
    actions = encoder_actions(plan.micro_batches, trains=False)
    for v in range(plan.steps_per_epoch):
        EncoderStep(w, data, plan, v, StepKey(step, v), grad=False).run(actions)


def _evaluate(w: PartWorker, data, plan, step: int) -> list[float]:
    """Encode the validation set for the LLM group (which computes the loss)."""
    _encode_all(w, data, plan, step)
    return [0.0] * step_end.eval_width(w.ctx.cfg)


def _reference_pass(w: PartWorker, data, plan) -> None:
    """Encode every training sample once for the LLM group's reference log-probs
    (``DPO(reference="precompute")``), forward only, before the first step."""
    w.model.eval()  # the initial model as a reference runs: no dropout
    try:
        _encode_all(w, data, plan, -1)
    finally:
        w.model.train()
    w.state.restart_clock()  # the pass is not the first step's time


def encoder_train_loop(args: LoopArgs, part: str) -> None:
    w = PartWorker(args, part)
    model = w.build()
    start = w.setup(model)  # the plans (parallelize_part), FSDP2, weights, optimizer
    ctx = w.ctx  # an encoder group's is fixed: a failure restarts the group's workers
    reference = w.build_reference()  # an objective's frozen copy of a trained tower
    limit = ctx.cfg.max_in_flight or 1
    actions = encoder_actions(ctx.cfg.micro_batches, limit, trains=not ctx.frozen)
    data = ingest.Datasets({"train": args.dataset_ref, "validation": args.val_ref})
    evaluate = None
    if args.val_plan is not None:
        evaluate = functools.partial(_evaluate, w, data, args.val_plan)
    if args.runs_reference_pass(start, ctx.channel.spec.restarts.get(part, 0)):
        _reference_pass(w, data, args.reference_plan)
    for step in range(start, ctx.cfg.max_steps):
        train_step(w, data, step, actions, reference, evaluate)
