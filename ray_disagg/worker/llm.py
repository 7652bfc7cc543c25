"""The worker loop of the LLM group: it builds the LLM's part, its data source, the
validation pass and, for ``DPO(reference="precompute")``, the reference's log-probs,
then runs one :func:`~ray_disagg.worker.llm_step.train_step` per step (the step itself,
top to bottom: ``worker/llm_step.py``). When an encoder group fails and restarts alone,
the LLM group keeps its workers: it reloads the latest checkpoint in place and goes on
(:func:`ray_disagg.worker.recovery.recover`)."""

from __future__ import annotations

import functools
import time

from ray_disagg.data.mixture import Mixture
from ray_disagg.pipeline.messages import StepKey
from ray_disagg.pipeline.schedule import llm_actions
from ray_disagg.worker import ingest, recovery
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.console import log_line
from ray_disagg.worker.llm_batch import LLMModel
from ray_disagg.worker.llm_step import LLMStep, train_step
from ray_disagg.worker.metrics import plain
from ray_disagg.worker.objective import ObjectiveRunner
from ray_disagg.worker.part_worker import PartWorker
from ray_disagg.worker.rollout import Rollouts
from ray_disagg.worker.session import get_session


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
    objective = None
    if cfg.objective is not None:
        objective = ObjectiveRunner(w, w.build_reference())
    llm = LLMModel(w, model, objective)
    if objective is not None and cfg.objective.reference == "precompute":
        _precompute(w, llm, data, start)
    rollouts = Rollouts(llm) if objective is not None and cfg.objective.generates else None
    evaluate = None
    if args.val_plan is not None:
        val_data = get_session().fetch(args.val_ref[0])
        val = ingest.MapStyleSource(val_data, args.val_plan, ctx.part, split="validation")
        evaluate = functools.partial(_evaluate, llm, val)
        if rollouts is not None:  # GRPO: greedy completions of the validation prompts
            evaluate = functools.partial(rollouts.evaluate, val)
    limit = cfg.max_in_flight or 1
    actions = llm_actions(cfg.micro_batches, limit, sends_grads=bool(llm.grad_names))
    step = start
    while step < cfg.max_steps:
        try:
            train_step(w, llm, source, step, actions, evaluate, rollouts)
        except recovery.GroupFailed:  # an encoder group restarts; this group waits
            step = recovery.recover(w, model)
            if llm.load is not None:  # the abandoned step's routing is not counted
                llm.load.reset()
            continue
        step += 1
