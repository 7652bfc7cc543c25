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
from ray_disagg.launch.checks import (
    check_budget,
    resolve_objective,
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
    ipc = placement == "colocated" and transfer in ("auto", "cuda_ipc")
    ipc = ipc and all(g.scaling_config.use_gpu for g in groups.values())
    restartable = frozenset()
    if restart_failed_group:
        restartable = restartable_groups(adapter, data.streamed, ipc)
    elastic = elastic_ranges(groups, adapter, placement, restartable)
    check_budget(loop, data.kind, elastic)
    colocation = colocation_for(groups, placement)
    transfer = validate_transfer(transfer, groups)
    standby = standby_groups(groups, placement, restartable, loop)
    sizes = elastic_sizes(elastic, loop)
    groups = {n: g.at_size(sizes[n][0]) if n in sizes else g for n, g in groups.items()}
    validate_layout(adapter, groups)
    if check_weights:
        model.check_weights()
    lora = check_lora(model, groups)
    frozen = frozen_parts(model, groups)
    validated = data.validate_samples and not data.streamed
    loop = resolve_schedule(loop, placement, data.kind, validated)
    validate_loop(adapter, loop, model.attn_implementation)
    trained = [p for p in groups if p not in frozen]
    loop = resolve_objective(loop, data, lora, trained)
    check_generation(adapter, groups, loop, model)
    if loop.eval_every is not None and not data.validation:
        raise ValueError(
            "train_loop_config['eval_every'] is set but there is no validation set: "
            'pass datasets={"train": ..., "validation": ...} (a recipe: data.validation), '
            "or drop eval_every."
        )
    return RunLayout(
        groups=groups, loop=loop, placement=placement, colocation=colocation,
        transfer=transfer, restartable=restartable, elastic_sizes=sizes, standby=standby,
        frozen_parts=frozen, lora_parts=frozenset(lora), samples_validated=validated,
    )  # fmt: skip
