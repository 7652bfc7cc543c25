"""``DisaggregatedTrainer``: a Ray Train trainer with one worker group per model module."""

from __future__ import annotations

import functools
import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import ray
from ray.train import Checkpoint, Result, RunConfig, ScalingConfig

from ray_disagg.config.groups import ModuleGroup
from ray_disagg.config.layout import DataSpec, resolve
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.run_warnings import emit
from ray_disagg.data.mixture import Mixture
from ray_disagg.launch import datasets as dsc
from ray_disagg.launch import ray_compat as rc
from ray_disagg.launch.backend import ModuleBackendConfig
from ray_disagg.launch.checks import check_reference_resume
from ray_disagg.launch.controller import DisaggregatedController
from ray_disagg.launch.launches import GroupLaunch, Launch, Transfers
from ray_disagg.launch.mixtures import check_mixture_resume
from ray_disagg.launch.progress import RunProgress
from ray_disagg.launch.recovery.elastic import ElasticGroup
from ray_disagg.launch.recovery.policies import GroupFailurePolicy
from ray_disagg.launch.resources import (
    Placement,
    check_cluster_capacity,
    demand_lines,
    stream_actor_cpus,
)
from ray_disagg.launch.teardown import interrupt_aborts, leave_nothing
from ray_disagg.launch.trackers import check_report_to
from ray_disagg.lora.parts import check_lora_resume
from ray_disagg.model import HFModelSpec
from ray_disagg.pipeline.assignment import BatchPlan
from ray_disagg.run_files import RunDir, load_metrics
from ray_disagg.transport.base import Tier
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.drill_env import FAULT_DRILL_ENV
from ray_disagg.worker.encoder import encoder_train_loop
from ray_disagg.worker.llm import llm_train_loop
from ray_disagg.worker.shards import check_compatible
from ray_disagg.worker.standby import StandbyLoop

__all__ = ["DisaggregatedTrainer", "load_metrics"]


def _train_fn(loop, backend) -> rc.ObjectRefWrapper:
    fn = rc.construct_train_func(
        loop,
        config=None,
        train_func_context=backend.train_func_context,
        fn_arg_name="train_loop_per_worker",
    )
    return rc.ObjectRefWrapper(fn)


def _fetch(controller, n: int) -> list[dict]:
    """The run's reported steps after the first ``n`` (from the coordinator's feed);
    ``TimeoutError`` while the coordinator is busy (it starts groups in its event loop),
    ``RayActorError`` once it is gone."""
    return ray.get(controller.reported_since.remote(n), timeout=10)


def _not_called(*_args, **_kwargs):
    raise RuntimeError("DisaggregatedTrainer runs its own per-group training loops.")


class DisaggregatedTrainer(rc.TrainerBase):
    """Train a multimodal model with one Ray Train worker group per part of the model.

    The groups are the family adapter's parts (``ray_disagg.models``): encoder groups
    (``"vision"``, and ``"audio"`` for Qwen2.5-Omni) and the LLM group ``"text"``
    (embeddings, decoder, lm_head, loss). Each group has its own ``ScalingConfig``,
    parallelism and torch process group; encoder outputs flow to the LLM group and their
    gradients back every step. ``fit()`` returns one ``ray.train.Result`` whose checkpoint
    holds one directory of shards per group plus the HF ``config.json``.

    Before any worker starts, the groups' total demand is compared with the cluster: an
    infeasible one is a ``ValueError`` (``wait_for_resources=True`` waits instead, for an
    autoscaling cluster); a start that waits longer than ``start_timeout_s`` raises.
    Every group's placement group is removed when ``fit()`` ends, however it ends.

    ``placement="separate"`` (default) gives each group its own placement group;
    ``placement="colocated"`` puts worker ``i`` of every group into bundle ``i`` of one
    placement group (e.g. ``resources_per_worker={"GPU": 0.5}`` in each group shares GPU
    ``i`` between vision worker ``i`` and text worker ``i``). Tensors cross between two
    workers over the fastest tier that works where they are (``transfer="auto"``: CUDA IPC
    on one GPU, NCCL between GPUs, shared memory between CPU processes of one node, else
    gloo); ``transfer="gloo"`` (or another tier) forces one. The metric ``transfer_tier``
    names the tiers in use.

    Restarts (``FailureConfig(max_failures=K)``) and a rerun with the same
    ``RunConfig(name=..., storage_path=...)`` continue from the latest checkpoint;
    ``resume_from_checkpoint`` starts from a given one (of any layout). A failed encoder
    group restarts alone where it can (``restart_failed_group``;
    ``docs/checkpoints-and-recovery.md``).

    While ``fit()`` runs, the driver prints the layout, one line per reported step (a live
    bar when stdout is a terminal) and a summary at the end
    (:mod:`ray_disagg.launch.progress`); Ray Train's own log line of every report, and
    Ray Data's progress bars of the datasets the run reads (on the driver and in the
    workers), are off unless ``verbose=True``. ``report_to``: experiment trackers
    (``"tensorboard"``, ``"mlflow"``, ``"wandb"``) the driver logs every reported step
    and the run's settings to (:mod:`ray_disagg.launch.trackers`).

    Example:
        >>> import ray
        >>> from ray.train import RunConfig, ScalingConfig
        >>> from ray_disagg import DisaggregatedTrainer, HFModelSpec, ModuleGroup
        >>> from ray_disagg import tiny_qwen2_5_vl_config
        >>> from ray_disagg.data.examples import digits_samples
        >>> cfg = tiny_qwen2_5_vl_config()
        >>> trainer = DisaggregatedTrainer(  # doctest: +SKIP
        ...     model=HFModelSpec(config=cfg),
        ...     groups={
        ...         "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
        ...         "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
        ...     },
        ...     train_loop_config={"lr": 1e-3, "max_steps": 20, "global_batch_size": 4},
        ...     datasets={"train": digits_samples(cfg, n=64)},
        ...     run_config=RunConfig(name="tiny-vlm", storage_path="/tmp/ray_disagg_runs"),
        ... )
        >>> result = trainer.fit()  # doctest: +SKIP
        >>> result.metrics["loss"]  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        model: HFModelSpec,
        groups: Mapping[str, ModuleGroup],
        train_loop_config: TrainLoopConfig | dict[str, Any] | None = None,
        datasets: Mapping[str, Any] | None = None,
        run_config: RunConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        validate_samples: bool = True,
        wait_for_resources: bool = False,
        start_timeout_s: float = 600.0,
        placement: Placement = "separate",
        transfer: Literal["auto"] | Tier = "auto",
        restart_failed_group: bool = True,
        verbose: bool = False,
        report_to: Sequence[str] | str | None = None,
    ):
        if not isinstance(model, HFModelSpec):
            raise ValueError(
                f"model must be an HFModelSpec (config= or pretrained_path=), got "
                f"{type(model).__name__}."
            )
        self.model_spec = model
        self.adapter = model.adapter
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s={start_timeout_s!r}: must be > 0 seconds.")
        self.wait_for_resources, self.start_timeout_s = wait_for_resources, start_timeout_s
        self.verbose = verbose
        self.restart_failed_group = restart_failed_group
        if resume_from_checkpoint is not None and not isinstance(
            resume_from_checkpoint, Checkpoint
        ):
            raise ValueError("resume_from_checkpoint must be a ray.train.Checkpoint.")
        self.resume_from_checkpoint = resume_from_checkpoint
        self.layout = layout = resolve(
            model, groups, train_loop_config, placement=placement, transfer=transfer,
            restart_failed_group=restart_failed_group,
            data=DataSpec.of(datasets, validate_samples),
        )  # fmt: skip
        emit(layout.warnings)
        self.train_data = datasets["train"]
        self.groups, self.loop_config = dict(layout.groups), layout.loop
        self.placement, self.transfer = placement, layout.transfer
        self.colocation, self.standby = layout.colocation, layout.standby
        self.elastic_sizes = layout.elastic_sizes
        self.frozen_parts, self._samples_validated = layout.frozen_parts, layout.samples_validated
        if resume_from_checkpoint is not None:
            self._check_resume(resume_from_checkpoint)
        self._plan_data(datasets, validate_samples)
        total = sum(g.num_workers for g in self.groups.values())
        super().__init__(
            _not_called,
            train_loop_config={"ray_disagg": True},
            scaling_config=ScalingConfig(num_workers=total),
            run_config=run_config,
        )
        self.report_to = check_report_to(report_to)

    def _check_resume(self, checkpoint: Checkpoint) -> None:
        """The checkpoint to resume from fits this run (config, steps, LoRA, DPO's
        precomputed reference), on the driver."""
        model = self.model_spec
        with checkpoint.as_directory() as root:
            check_compatible(root, model.load_config(), self.loop_config.max_steps)
            check_lora_resume(root, model, self.groups)
            check_reference_resume(root, self.adapter.llm_part, self.loop_config)
            check_mixture_resume(root, self.train_data, self.adapter.llm_part)

    def _plan_data(self, datasets, validate_samples: bool) -> None:
        """The plan of every step's samples (map-style samples checked and costed here)
        and the validation set's; Ray Data's progress bars of these reads as ``verbose``."""
        with dsc.progress_bars(datasets.values(), shown=self.verbose):
            self.plan: BatchPlan = dsc.batch_plan(
                self.train_data, self.adapter, self.loop_config, self.groups,
                self._samples_validated,
            )  # fmt: skip
            self._val_data, self.val_plan = dsc.validation_set(
                datasets, self.adapter, self.loop_config, self.groups, validate_samples
            )

    def worker_env_vars(self) -> dict[str, str]:
        """Environment variables every worker gets on top of Ray Train's: a fault drill
        armed in the driver's environment (``ray_disagg.testing.faults``)."""
        drill = os.environ.get(FAULT_DRILL_ENV)
        return {FAULT_DRILL_ENV: drill} if drill else {}

    def transfer_pairs(self, args: LoopArgs | None = None) -> tuple:
        """``((encoder, rank), (llm, rank))`` for every pair of replica leaders that may
        exchange tensors under the plan (overlapping slices, or the neighbours when
        balanced: :mod:`ray_disagg.pipeline.neighbours`);
        ``args``: at an elastic group's size (default: the initial one)."""
        llm = self.adapter.llm_part
        g, plan = (self.groups, self.plan) if args is None else (args.groups, args.plan)
        pairs = set()
        for part in self.adapter.encoder_parts:
            for d, t in plan.exchange_pairs(part, llm):
                leaders = (d * g[part].model_parallel_size, t * g[llm].model_parallel_size)
                pairs.add(((part, leaders[0]), (llm, leaders[1])))
        return tuple(sorted(pairs))

    # ---- Ray Train hooks ------------------------------------------------------------

    def default_callbacks(self, callbacks: list) -> list:
        # Backend/accelerator setup is per group (added by the coordinator); the LLM group
        # reads the data (no DatasetsCallback); the driver removes every group's
        # reservation by the run's name (launch.teardown), without the dashboard Ray
        # Train's cleaner needs.
        dropped = (
            rc.AcceleratorSetupCallback,
            rc.BackendSetupCallback,
            rc.DatasetsCallback,
            rc.PlacementGroupCleanerCallback,
        )
        return [c for c in callbacks if not isinstance(c, dropped)]

    def loop_args(self, put=None, driver_progress: bool = False) -> LoopArgs:
        """What every worker's loop gets; ``put`` stores the datasets for the workers
        (``ray.put`` by default; the tests' local runner passes them as they are);
        ``driver_progress``: the driver prints the steps (it takes them from the reports)."""
        put = put or ray.put
        return LoopArgs(
            spec=self.model_spec,
            cfg=self.loop_config,
            groups=self.groups,
            plan=self.plan,
            dataset_ref=[put(self.train_data)],
            resume_from_checkpoint=self.resume_from_checkpoint,
            samples_validated=self._samples_validated,
            run_dir=self.run_dir(),
            driver_progress=driver_progress,
            frozen_parts=self.frozen_parts,
            sources=self.train_data.names if isinstance(self.train_data, Mixture) else (),
            val_ref=None if self._val_data is None else [put(self._val_data)],
            val_plan=self.val_plan,
            group_recovery=bool(self.restartable_groups()),
            recovery_timeout_s=self.start_timeout_s + self.loop_config.collective_timeout_s,
        )

    def run_dir(self) -> RunDir:
        """The run's directory on its storage (``RunConfig(storage_path, name)``, as Ray
        Train resolves it: local, mounted, S3, GCS or ``storage_filesystem``)."""
        rc_ = self.run_config
        fs, root = rc.storage_location(rc_.storage_path, rc_.storage_filesystem)
        return RunDir(fs, posixpath.join(root, rc_.name))

    def tracker_dir(self) -> str:
        """Where the trackers keep their files by default (``report_to``): the run
        directory when it is local, else ``~/ray_results/<name>`` on the driver. (Read from
        the settings, not :meth:`run_dir`: resolving an S3 URI may ask the network for
        the bucket's region.)"""
        run = self.run_config
        storage = run.storage_filesystem is None and os.fspath(run.storage_path)
        if storage and storage.startswith("file://"):
            storage = storage.removeprefix("file://")
        if storage and "://" not in storage:
            return os.path.join(os.path.expanduser(storage), run.name)
        return os.path.join(os.path.expanduser("~/ray_results"), run.name)

    def restartable_groups(self) -> frozenset[str]:
        """The groups a worker failure restarts alone (``ray_disagg.config.layout``)."""
        return self.layout.restartable

    def group_loops(self, args: LoopArgs) -> dict[str, tuple]:
        """Per group, the LLM group first: ``(train loop, backend config)``. (The union's
        rank 0 is then the LLM group's rank 0, whose metrics, with the data-derived ones,
        e.g. sample_ids, the Result keeps.)"""
        out = {}
        llm = self.adapter.llm_part
        for name in [llm, *(n for n in args.groups if n != llm)]:
            group = args.groups[name]
            if name == llm:
                loop = functools.partial(llm_train_loop, args)
            else:
                loop = functools.partial(encoder_train_loop, args, name)
            shape, axes = group.mesh_layout
            backend = ModuleBackendConfig(
                module=name,
                mesh_shape=shape,
                mesh_axes=axes,
                timeout_s=self.loop_config.collective_timeout_s,
                verbose=self.verbose,
            )
            out[name] = (loop, backend)
        return out

    def _launches(self) -> tuple[Launch, ElasticGroup | None]:
        """Every group's launch at the initial sizes, and the elastic group (its launches
        at each size it may take) if any."""
        args = self.loop_args(driver_progress=True)
        if not self.elastic_sizes:
            return self._launch(args), None
        ((name, sizes),) = self.elastic_sizes.items()
        sc = self.groups[name].scaling_config
        group = ElasticGroup(
            name=name,
            launches={n: self._launch(args.at_sizes({name: n})) for n in sizes},
            per_worker=rc.resources_per_worker(sc),
            strategy=sc.placement_strategy,
            interval_s=sc.elastic_resize_monitor_interval_s,
            max_steps=self.loop_config.max_steps,
        )
        return group.launches[sizes[0]], group

    def _launch(self, args: LoopArgs) -> Launch:
        launches = {}
        for name, (loop, backend) in self.group_loops(args).items():
            standby = None
            if name in self.standby:  # its standby builds the model, then waits
                standby = StandbyLoop(loop)
            launches[name] = GroupLaunch(
                name=name,
                scaling_config=args.groups[name].scaling_config,
                backend_config=backend,
                train_fn_ref=_train_fn(loop, backend),
                standby_fn_ref=standby and _train_fn(standby, backend),
            )
        return Launch(launches, Transfers(self.transfer_pairs(args), self.transfer))

    def run_controller(self, **controller_init_kwargs) -> Result:
        stream = stream_actor_cpus(self.train_data, self.groups[self.adapter.llm_part].dp_size)
        check_cluster_capacity(self.groups, self.wait_for_resources, self.colocation, stream)
        ctx = controller_init_kwargs.pop("train_run_context")
        ctx = rc.with_worker_env_vars(ctx, self.worker_env_vars())
        # Ray's failure policy, plus the failures the coordinator handles itself
        controller_init_kwargs["failure_policy"] = GroupFailurePolicy(
            self.run_config.failure_config
        )
        launch, elastic = self._launches()
        controller, finished = None, False
        try:
            controller = rc.run_controller_actor(
                DisaggregatedController,
                launch=launch,
                elastic=elastic,
                side_timeout_s=self.loop_config.collective_timeout_s,
                start_timeout_s=self.start_timeout_s,
                demand=demand_lines(self.groups, self.colocation),
                colocation=self.colocation,
                restartable=self.restartable_groups(),
                train_run_context=ctx,
                **controller_init_kwargs,
            )
            fetch = functools.partial(_fetch, controller)
            with (
                RunProgress(self, fetch) as progress,
                interrupt_aborts(controller, before_abort=progress.take),
            ):
                ray.get(controller.run.remote())
                finished = True  # the result, or the run's failure
                return progress.finish(ray.get(controller.get_result.remote()))
        finally:  # success, failure, a dead coordinator, an interrupt, a driver error
            leave_nothing(controller, ctx.run_id, finished)
