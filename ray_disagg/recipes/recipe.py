"""Recipes: one YAML file with everything a :class:`~ray_disagg.DisaggregatedTrainer` run
needs, turned into the trainer's keyword arguments (``ray-disagg train|plan`` read them).

Schema (``model``, ``data.train``, ``groups`` and ``train_loop_config`` are required)::

    model:
      pretrained_path: /models/Qwen2.5-VL-32B-Instruct  # local save_pretrained dir (or null)
      config: tiny_qwen2_5_vl    # preset name | {preset: NAME, **kwargs} | HF dict with
      seed: 0                    # model_type; random init without pretrained_path, else
      attn_implementation: sdpa  # only `plan`'s fallback when the path is not on this machine
    data:                        # train (required) and validation, each one source:
      train: {type: digits, num_samples: 512, start: 0, image_size: 16}
      validation: {type: conversations, records: val.jsonl, media_root: images/,
                   tokenizer: null, image_processor: null, min_pixels: null, max_pixels: null}
      # or {type: parquet, paths: s3://bucket/train/} / {type: json, paths: [...]} (Ray Data)
    groups:                      # one entry per part of the model (vision, text, ...)
      vision: {num_workers: 1, use_gpu: false, resources_per_worker: null,
               placement_strategy: PACK, parallelism: none, activation_checkpointing: false,
               trainable: true, freeze: [], lr_multiplier: 1.0, standby: false}
      text: {num_workers: 2, parallelism: {type: tensor, size: 2}}
      # parallelism: none | {type: data, zero1, fsdp} | {type: sequence, size, zero1, fsdp}
      #              | {type: tensor, size, fsdp} | {type: context, size, tp, fsdp}
      #              | {type: expert, size, tp, fsdp}  (an MoE LLM's experts over size)
    placement: separate          # separate | colocated
    transfer: auto               # auto | gloo | shm | nccl | cuda_ipc
    wait_for_resources: false    # true on an autoscaling cluster
    train_loop_config: {max_steps: 40, global_batch_size: 16}  # TrainLoopConfig, as is
    run_config: {name: NAME, storage_path: ~/ray_results, max_failures: 0,
                 checkpoint: {num_to_keep: null, score_attribute: null, order: max}}
    plan: {image_size: [448, 448], images_per_sample: 1, seq_len: null}  # for `plan` only

Overrides are dotted keys with YAML values (``train_loop_config.lr=1e-4``,
``groups.vision.trainable=false``). Relative paths are relative to the working directory.
Every error is a ``ValueError`` naming the key path and the allowed values.

Example:
    >>> r = load_recipe("digits_cpu", ["train_loop_config.max_steps=4"])
    >>> r.loop.max_steps, r.groups["vision"].num_workers, r.placement
    (4, 1, 'separate')
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from ray.train import RunConfig

from ray_disagg.config.groups import ModuleGroup, TrainLoopConfig
from ray_disagg.config.layout import RunLayout, resolve
from ray_disagg.config.refusals import Refusals
from ray_disagg.launch.checks import resolve_rollouts
from ray_disagg.launch.resources import PLACEMENTS
from ray_disagg.model import HFModelSpec
from ray_disagg.recipes.data import build_dataset, check_sources, data_spec, parse_data
from ray_disagg.recipes.schema import (
    REQUIRED,
    RecipeError,
    apply_overrides,
    at,
    check,
    choice,
    fail,
    load_yaml,
    section,
)
from ray_disagg.recipes.sections import (
    TOP,
    group_section,
    model_section,
    plan_section,
    report_to_section,
    run_config_section,
)
from ray_disagg.recipes.words import recipe_message
from ray_disagg.transport import TIERS

__all__ = [
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "build_dataset",
    "bundled_recipes",
    "load_recipe",
    "trainer_kwargs",
]


@dataclasses.dataclass
class Recipe:
    """A parsed recipe: the trainer's arguments, except the datasets (see ``data``)."""

    name: str
    model: HFModelSpec
    model_source: str
    """Where the model comes from, in words (pretrained weights, config, plan fallback)."""
    groups: dict[str, ModuleGroup]
    loop: TrainLoopConfig
    placement: str
    transfer: str
    wait_for_resources: bool
    data: dict[str, dict]
    """``{"train": {"type": ..., ...}, "validation": ...}`` with defaults filled in."""
    run_config: RunConfig
    plan: dict
    raw: dict
    report_to: tuple[str, ...] = ()
    """``run_config.report_to``: the experiment trackers (``DisaggregatedTrainer(report_to=)``)."""
    layout: RunLayout | None = None
    """What :func:`ray_disagg.config.layout.resolve` made of the run (as the trainer will)."""


def bundled_recipes() -> dict[str, Path]:
    """The recipes shipped in ``ray_disagg/recipes`` by name (file stem)."""
    root = resources.files("ray_disagg") / "recipes"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def _read(source) -> tuple[str, dict]:
    if isinstance(source, dict):
        return "recipe", source
    path, bundled = Path(os.fspath(source)).expanduser(), bundled_recipes()
    if not path.is_file():
        # only a bare name means a bundled recipe; a missing file path is an error
        is_name = os.sep not in os.fspath(source) and not path.suffix
        path = bundled.get(path.name) if is_name else None
        if path is None:
            fail(
                f"recipe {os.fspath(source)!r}: no such file and not a bundled recipe "
                f"(bundled: {sorted(bundled)})."
            )
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        fail(f"recipe {str(path)!r} is not valid YAML: {e}")
    if not isinstance(raw, dict):
        fail(f"recipe {str(path)!r}: must be a mapping with keys {sorted(TOP)}.")
    return path.stem, raw


def load_recipe(source, overrides=(), *, for_training: bool = False) -> Recipe:
    """Read a recipe (a path, a bundled recipe's name, or a dict), apply ``overrides`` and
    check it as ``DisaggregatedTrainer`` does on the driver (no Ray, no worker).

    ``for_training``: ``model.pretrained_path`` must exist (``plan`` falls back to the
    inline ``model.config``) and weights are left for the trainer to check."""
    name, raw = _read(source)
    try:
        raw = apply_overrides(raw, overrides)
        top = section(raw, "recipe", TOP)
        model, model_source = model_section(top["model"], for_training)
        recipe = _sections(name, top, model, raw)
        recipe.model_source = model_source
    except ValueError as e:
        raise RecipeError(recipe_message(name, e)) from None
    _check_run(recipe, for_training)
    recipe.groups = {n: recipe.groups[n] for n in recipe.layout.groups}  # the parts' order
    return recipe


def _sections(name: str, top: dict, model: HFModelSpec, raw: dict) -> Recipe:
    """The recipe's sections after ``model``, each checked on its own and every refusal
    reported together."""
    refusals, parts = Refusals(), list(model.adapter.parts)
    groups_raw, groups, data, loop = top["groups"], {}, {}, None
    if not isinstance(groups_raw, dict):
        fail(f"groups: must be a mapping over the model's parts {parts}.")
    unknown = sorted(set(groups_raw) - set(parts))
    if unknown:
        refusals.errors.append(RecipeError(
            f"groups: unknown group(s) {unknown}; {model.adapter.model_type} has groups {parts}."
        ))  # fmt: skip
    for n, v in groups_raw.items():
        with refusals.check():
            groups[n] = group_section(n, v)
    before = len(refusals.errors)
    with refusals.check():
        data = section(top["data"], "data", {"train": REQUIRED, "validation": None})
    data = {k: v for k, v in data.items() if v is not None}
    for k, v in data.items():
        with refusals.check():
            data[k] = parse_data(v, f"data.{k}")
    data_ok = len(refusals.errors) == before
    with refusals.check():
        check(top["wait_for_resources"], "wait_for_resources", bool, "true or false")
    with refusals.check(), at("train_loop_config"):
        loop = TrainLoopConfig.from_any(top["train_loop_config"])
    with refusals.check():
        choice(top["placement"], "placement", PLACEMENTS)
    with refusals.check():
        choice(top["transfer"], "transfer", ("auto", *TIERS))
    run = {}
    with refusals.check():
        run["run_config"] = run_config_section(top["run_config"], name)
    with refusals.check():
        run["report_to"] = report_to_section(top["run_config"])
    if data_ok:  # the plan's defaults read the data
        with refusals.check():
            run["plan"] = plan_section(top["plan"], data)
    refusals.raise_any()
    return Recipe(
        name=name, model=model, model_source="", groups=groups, loop=loop,
        placement=top["placement"], transfer=top["transfer"],
        wait_for_resources=top["wait_for_resources"], data=data, raw=raw, **run,
    )  # fmt: skip


def _check_run(recipe: Recipe, for_training: bool) -> None:
    """What the trainer checks on the driver (:func:`~ray_disagg.config.layout.resolve`)
    and the recipe's own cross-key checks, every independent refusal reported together
    in the recipe's words (``RecipeError``)."""
    refusals, spec = Refusals(), data_spec(recipe.data)
    with refusals.check():
        recipe.layout = resolve(
            recipe.model, recipe.groups, recipe.loop, placement=recipe.placement,
            transfer=recipe.transfer, data=spec, check_weights=not for_training,
        )  # fmt: skip
    score = recipe.run_config.checkpoint_config.checkpoint_score_attribute
    obj = resolve_rollouts(recipe.loop, spec).objective
    if score == "val_loss" and ("validation" not in recipe.data or obj is not None):
        fix = "add data.validation, or set run_config.checkpoint.score_attribute: null"
        if obj is not None:  # GRPO's validation reports eval_reward; DPO's, nothing
            name = type(obj).__name__
            fix = (f"{name} reports no val_loss; set run_config.checkpoint.score_attribute: "
                   + ("eval_reward (order: max)" if obj.generates else "null"))  # fmt: skip
        refusals.errors.append(RecipeError(
            f"run_config.checkpoint.score_attribute: val_loss needs a validation loss: {fix}."
        ))  # fmt: skip
    with refusals.check():
        check_sources(recipe, for_training)
    try:
        refusals.raise_any()
    except ValueError as e:
        raise RecipeError(recipe_message(recipe.name, e)) from None


def trainer_kwargs(recipe: Recipe) -> dict[str, Any]:
    """Keyword arguments of ``DisaggregatedTrainer`` (loads the datasets)."""
    return dict(
        model=recipe.model,
        groups=recipe.groups,
        train_loop_config=recipe.loop,
        datasets={k: build_dataset(recipe, k) for k in recipe.data},
        run_config=recipe.run_config,
        placement=recipe.placement,
        transfer=recipe.transfer,
        wait_for_resources=recipe.wait_for_resources,
        report_to=recipe.report_to,
    )
