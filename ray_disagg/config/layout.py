"""One place that accepts or refuses a run: :func:`resolve`.

``DisaggregatedTrainer(...)``, the recipe loader (``ray-disagg plan`` and ``ray-disagg
train``, before Ray starts) and the planner (each layout it enumerates) call it, so all
of them accept and refuse the same runs with the same message. It needs the model's
config, the groups, the loop settings and what kind of data the run reads
(:class:`DataSpec`), never the samples: the checks that read samples (their fields,
lengths and costs) stay with the trainer.

Example:
    >>> from ray.train import ScalingConfig
    >>> from ray_disagg import HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
    >>> one = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    >>> layout = resolve(
    ...     HFModelSpec(config=tiny_qwen2_5_vl_config()),
    ...     {"vision": one, "text": one},
    ...     {"max_steps": 4, "global_batch_size": 2, "micro_batches": 2},
    ...     data=DataSpec(kind="map"),
    ... )
    >>> layout.loop.schedule, layout.restartable
    ('1f1b', frozenset({'vision'}))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ray_disagg.config.freezing import frozen_parts
from ray_disagg.config.groups import ModuleGroup
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.refusals import Refusal, Refusals
from ray_disagg.config.run_warnings import run_warnings
from ray_disagg.launch.checks import (
    check_budget,
    resolve_objective,
    resolve_rollouts,
    resolve_schedule,
    validate_groups,
    validate_layout,
    validate_loop,
    validate_transfer,
)
from ray_disagg.launch.generation_checks import check_generation
from ray_disagg.launch.launches import Colocation
from ray_disagg.launch.recovery.elastic import elastic_ranges, elastic_sizes
from ray_disagg.launch.recovery.standby import standby_groups
from ray_disagg.launch.recovery.survivors import restartable_groups
from ray_disagg.launch.resources import colocation_for
from ray_disagg.lora.parts import check_lora

__all__ = ["DataSpec", "RunLayout", "resolve"]


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The run's data as :func:`resolve` needs it: its kind, not its samples."""

    kind: Literal["map", "ray", "stream"] = "map"
    """``"map"``: a map-style dataset (a list of samples, a ``datasets.Dataset``), whose
    samples the driver checks before the run; ``"ray"``: a ``ray.data.Dataset`` and
    ``"stream"``: a ``ConversationStream``, both read while training runs."""

    validation: bool = False
    """A validation set is given (``datasets["validation"]``)."""

    validate_samples: bool = True
    """The trainer's ``validate_samples``: the driver checks every map-style sample."""

    pairs: bool | None = None
    """Whether the data are preference pairs (a stream through a ``PreferenceProcessor``,
    a recipe's ``preference`` source); ``None``: known from the samples only."""

    recorded: bool = False
    """The samples carry completions (GRPO's recorded rollouts: the first map-style
    sample has ``completion_ids``); else GRPO generates them."""

    prompts: bool | None = None
    """Whether the data are prompts to complete (a stream through a ``PromptProcessor``,
    a recipe's ``prompts`` source); ``None``: known from the samples only."""

    @property
    def streamed(self) -> bool:
        return self.kind != "map"

    @classmethod
    def of(cls, datasets: Mapping[str, Any] | None, validate_samples: bool = True) -> DataSpec:
        """The spec of the trainer's ``datasets`` (``ValueError`` when they are not
        ``{"train": ..., "validation": ...}`` of supported kinds)."""
        from ray_disagg.data.preference import PreferenceProcessor
        from ray_disagg.data.prompts import PromptProcessor
        from ray_disagg.launch.datasets import train_set
        from ray_disagg.worker.ingest import is_ray_dataset, is_record_stream

        train = train_set(datasets)
        kind = "ray" if is_ray_dataset(train) else "stream" if is_record_stream(train) else "map"
        has_validation = datasets.get("validation") is not None
        pairs, recorded, prompts = None, False, None
        if kind == "stream":
            pairs = isinstance(train.processor, PreferenceProcessor)
            prompts = isinstance(train.processor, PromptProcessor)
        elif kind == "map" and len(train):
            recorded = "completion_ids" in train[0]
        return cls(
            kind=kind, validation=has_validation, validate_samples=validate_samples,
            pairs=pairs, recorded=recorded, prompts=prompts,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RunLayout:
    """A run :func:`resolve` accepted, with every default that depends on the run filled
    in."""

    groups: dict[str, ModuleGroup]
    """One group per part, in the adapter's order; an elastic group at its smallest size."""
    loop: TrainLoopConfig
    """With ``schedule``, ``max_in_flight`` and ``assignment`` resolved."""
    placement: str
    colocation: Colocation | None
    """The bundle every group shares (``placement="colocated"``), else ``None``."""
    transfer: str
    restartable: frozenset[str]
    """The groups a worker failure restarts alone."""
    elastic_sizes: dict[str, list[int]]
    """Per elastic group, the sizes it may take (ascending)."""
    standby: frozenset[str]
    """The groups with a standby copy."""
    frozen_parts: tuple[str, ...]
    """The parts whose every parameter is frozen."""
    lora_parts: frozenset[str]
    """The parts that train a LoRA adapter (:mod:`ray_disagg.lora`)."""
    samples_validated: bool
    """The driver checks every sample before the run (map-style data)."""
    warnings: tuple[str, ...] = ()
    """Settings that cannot do what they say (:func:`~ray_disagg.config.run_warnings.
    run_warnings`): printed by ``plan``, emitted by the trainer."""


def resolve(
    model,
    groups: Mapping[str, ModuleGroup],
    loop: TrainLoopConfig | dict[str, Any],
    *,
    placement: str = "separate",
    transfer: str = "auto",
    restart_failed_group: bool = True,
    data: DataSpec,
    check_weights: bool = True,
) -> RunLayout:
    """Accept the run (its :class:`RunLayout`) or refuse it (``ValueError`` naming the
    setting and the fix). ``model``: an ``HFModelSpec``; ``check_weights``: also check a
    pretrained directory's weights against the config (file headers only)."""
    adapter = model.adapter
    groups = validate_groups(groups, adapter)
    loop = TrainLoopConfig.from_any(loop)
    refusals = Refusals()  # independent checks, reported together
    placed = _place(adapter, groups, loop, placement, transfer, restart_failed_group, data,
                    refusals)  # fmt: skip
    groups, lora, frozen = placed.groups, None, None
    loop = resolve_rollouts(loop, data)  # what the checks below read of GRPO
    before = len(refusals.errors)
    with refusals.check():
        validate_layout(adapter, groups)
    laid_out = len(refusals.errors) == before
    if check_weights:
        with refusals.check():
            model.check_weights()
    if laid_out:  # LoRA and freezing are checked on a layout that stands
        with refusals.check():
            lora = check_lora(model, groups)
        with refusals.check():
            frozen = frozen_parts(model, groups)
    validated = data.validate_samples and not data.streamed
    with refusals.check():
        loop = resolve_schedule(loop, placement, data.kind, validated)
    with refusals.check():
        validate_loop(adapter, loop, model.attn_implementation)
    if lora is not None and frozen is not None:  # what the objective's checks read
        trained = [p for p in groups if p not in frozen]
        with refusals.check():
            loop = resolve_objective(loop, data, lora, trained)
            check_generation(adapter, groups, loop, model)
    with refusals.check():
        check_evaluation(loop, data.validation)
    refusals.raise_any()
    return RunLayout(
        groups=groups, loop=loop, placement=placement, colocation=placed.colocation,
        transfer=placed.transfer, restartable=placed.restartable,
        elastic_sizes=placed.elastic_sizes, standby=placed.standby,
        frozen_parts=frozen, lora_parts=frozenset(lora), samples_validated=validated,
        warnings=run_warnings(loop, data.validation),
    )  # fmt: skip


@dataclass(frozen=True)
class _Placed:
    groups: dict[str, ModuleGroup]
    colocation: Colocation | None
    transfer: str
    restartable: frozenset[str]
    elastic_sizes: dict[str, list[int]]
    standby: frozenset[str]


def _place(adapter, groups, loop, placement, transfer, restart_failed_group, data, refusals):
    """Where the groups run and how they recover (the refusals into ``refusals``)."""
    ipc = placement == "colocated" and transfer in ("auto", "cuda_ipc")
    ipc = ipc and all(g.scaling_config.use_gpu for g in groups.values())
    restartable = frozenset()
    if restart_failed_group:
        restartable = restartable_groups(adapter, data.streamed, ipc)
    elastic, colocation, standby, sizes = {}, None, frozenset(), {}
    with refusals.check():
        elastic = elastic_ranges(groups, adapter, placement, restartable)
    with refusals.check():
        check_budget(loop, data.kind, elastic)
    with refusals.check():
        colocation = colocation_for(groups, placement)
    with refusals.check():
        transfer = validate_transfer(transfer, groups)
    with refusals.check():
        standby = standby_groups(groups, placement, restartable, loop)
    with refusals.check():
        sizes = elastic_sizes(elastic, loop)
    groups = {n: g.at_size(sizes[n][0]) if n in sizes else g for n, g in groups.items()}
    return _Placed(groups, colocation, transfer, restartable, sizes, standby)


def check_evaluation(loop: TrainLoopConfig, validation: bool) -> None:
    """A validation set is evaluated under SFT and GRPO's generated completions only, and
    ``eval_every`` needs one; both refusals at once (dropping the set refuses
    ``eval_every``)."""
    obj, refusals = loop.objective, Refusals()
    name = type(obj).__name__
    evaluates = obj is None or obj.generates
    if validation and not evaluates:
        refusals.errors.append(Refusal(
            f"train_loop_config['objective']={name}: validation sets are evaluated under "
            "a per-sequence objective only for GRPO's generated completions (the rewards "
            "of greedy completions of validation prompts); drop datasets['validation'].",
            recipe=f"data.validation: under train_loop_config.objective {{type: "
            f"{name.lower()}}} there is no validation (it is evaluated under a "
            "per-sequence objective only for GRPO's generated completions); set "
            "data.validation: null.",
        ))  # fmt: skip
    if loop.eval_every is not None and not (validation and evaluates):
        why, add, yaml_add = f"{name} evaluates none", ".", "."
        if evaluates:
            why = "there is no validation set"
            add = ', or pass datasets={"train": ..., "validation": ...}.'
            yaml_add = ", or add data.validation."
        refusals.errors.append(
            Refusal(
                f"train_loop_config['eval_every'] is set but {why}: drop eval_every{add}",
                recipe=f"train_loop_config.eval_every is set but {why}: set "
                f"train_loop_config.eval_every: null{yaml_add}",
            )
        )
    refusals.raise_any()
