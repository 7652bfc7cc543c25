"""Everything a worker's loop needs, built on the driver and pickled into the train
function."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ray_disagg.config.groups import ModuleGroup, TrainLoopConfig
from ray_disagg.model import HFModelSpec
from ray_disagg.pipeline.assignment import BatchPlan, CoveringPlan
from ray_disagg.pipeline.budget import BudgetPlan
from ray_disagg.run_files import RunDir
from ray_disagg.worker.stats import StepStats


@dataclass
class LoopArgs:
    """Everything a worker's loop needs (pickled into the train function)."""

    spec: HFModelSpec
    cfg: TrainLoopConfig
    groups: dict[str, ModuleGroup]  # in the adapter's part order, the LLM part last
    plan: BatchPlan
    dataset_ref: list | None = None  # [ObjectRef]: a list keeps Ray from resolving it early
    resume_from_checkpoint: object = None
    samples_validated: bool = False  # the driver checked every sample before the run
    run_dir: RunDir | None = None  # the run's directory on its storage (trace files)
    driver_progress: bool = False  # the driver prints the steps (launch.progress), not rank 0
    frozen_parts: tuple[str, ...] = ()  # groups whose parameters are all frozen
    val_ref: list | None = None  # [ObjectRef] of the map-style validation samples
    val_plan: BatchPlan | None = None
    sources: tuple[str, ...] = ()  # a mixture's sources (per-source metrics)
    group_recovery: bool = False  # the LLM group survives an encoder group's restart
    recovery_timeout_s: float = 900.0  # how long survivors wait for the restarted group

    def at_sizes(self, sizes: dict[str, int]) -> LoopArgs:
        """These arguments with the groups' numbers of workers ``sizes`` (an elastic
        group's size: its plans re-split each batch over its new replicas);
        ``ValueError`` when a batch does not split evenly."""
        if all(self.groups[g].num_workers == n for g, n in sizes.items()):
            return self
        groups = {g: grp.at_size(sizes.get(g, grp.num_workers)) for g, grp in self.groups.items()}
        dp = {g: grp.dp_size for g, grp in groups.items()}
        val_plan = self.val_plan and dataclasses.replace(self.val_plan, dp_sizes=dp)
        plan = dataclasses.replace(self.plan, dp_sizes=dp)
        return dataclasses.replace(self, groups=groups, plan=plan, val_plan=val_plan)

    @property
    def reference_plan(self) -> BatchPlan:
        """The reference model's pass before training (``DPO(reference="precompute")``):
        every training sample once, in order, split over the groups as training is (under
        a token budget: its steps, unshuffled, repeats filling the last)."""
        p = self.plan
        if isinstance(p, BudgetPlan):
            return dataclasses.replace(p, shuffle=False, cover=True)
        return CoveringPlan(
            num_samples=p.num_samples,
            global_batch_size=p.global_batch_size,
            dp_sizes=p.dp_sizes,
            micro_batches=p.micro_batches,
            reader=p.reader,
            costs=p.costs,
        )

    def runs_reference_pass(self, start: int, restarts: int) -> bool:
        """Whether a group runs the reference's pass: at the start of a run with
        ``reference="precompute"``, unless the group was restarted alone (``restarts``:
        its restarts in this attempt; the LLM group kept its table then)."""
        obj = self.cfg.objective
        return obj is not None and obj.reference == "precompute" and start == 0 and not restarts

    def generates(self, step: int) -> bool:
        """Whether ``step`` begins with a rollout (``GRPO(rollouts="generate")``: the first
        of each batch's ``num_iterations`` steps)."""
        obj = self.cfg.objective
        return obj is not None and obj.generates and step % obj.num_iterations == 0

    @property
    def adapter(self):
        return self.spec.adapter

    @functools.cached_property
    def stats(self) -> StepStats:
        a = self.adapter
        counters = [c for p in a.encoder_parts for c in a.counter_names(p)]
        objective = self.cfg.objective
        metrics = None
        if objective is not None:
            metrics = (*objective.metric_names, *objective.step_metric_names)
        return StepStats(list(self.groups), counters, metrics, self.sources, a.llm_part)

    def leader_side_rank(self, channel, group: str, dp_rank: int) -> int:
        """Side rank of the model-parallel rank 0 of replica ``dp_rank`` of ``group``."""
        return channel.rank_of(group, dp_rank * self.groups[group].model_parallel_size)
