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
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from ray_disagg import models
from ray_disagg.config import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
)
from ray_disagg.model import HFModelSpec
from ray_disagg.recipes.data import build_dataset, parse_data
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

__all__ = [
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "build_dataset",
    "bundled_recipes",
    "load_recipe",
    "trainer_kwargs",
]

TOP = {
    "model": REQUIRED,
    "data": REQUIRED,
    "groups": REQUIRED,
    "train_loop_config": REQUIRED,
    "placement": "separate",
    "transfer": "auto",
    "wait_for_resources": False,
    "run_config": None,
    "plan": None,
}
MODEL = {"pretrained_path": None, "config": None, "seed": 0, "attn_implementation": "sdpa"}
GROUP = {
    "num_workers": 1,
    "use_gpu": False,
    "resources_per_worker": None,
    "placement_strategy": "PACK",
    "parallelism": "none",
    "activation_checkpointing": False,
    "trainable": True,
    "freeze": [],
    "lr_multiplier": 1.0,
    "standby": False,
}
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PARALLELISM = {  # type -> (class, allowed keys)
    "none": (DataParallel, ()),
    "data": (DataParallel, ("zero1", "fsdp")),
    "sequence": (SequenceParallel, ("size", "zero1", "fsdp")),
    "tensor": (TensorParallel, ("size", "fsdp")),
    "context": (ContextParallel, ("size", "tp", "fsdp")),
    "expert": (ExpertParallel, ("size", "tp", "fsdp")),
}
RUN = {"name": None, "storage_path": None, "max_failures": 0, "checkpoint": None}
CHECKPOINT = {"num_to_keep": None, "score_attribute": None, "order": "max"}
PLAN = {"image_size": None, "images_per_sample": 1, "seq_len": None}


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


def _model_config(cfg, path: str):
    presets = sorted(n.removesuffix("_config") for n in dir(models) if n.startswith("tiny_"))
    kwargs = {}
    if isinstance(cfg, dict) and "preset" in cfg:
        kwargs, cfg = {k: v for k, v in cfg.items() if k != "preset"}, cfg["preset"]
    if isinstance(cfg, str):
        name = cfg.removesuffix("_config")
        if name not in presets:
            fail(
                f"{path}={cfg!r}: unknown preset; presets: {presets} (or an HF config dict "
                "with model_type)."
            )
        with at(path):
            return getattr(models, f"{name}_config")(**kwargs)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        fail(
            f"{path}: must be a preset name {presets}, {{preset: NAME, ...kwargs}} or an HF "
            f"config dict with 'model_type' (one of {sorted(models.ADAPTERS)})."
        )
    return cfg


def _model(value, for_training: bool) -> tuple[HFModelSpec, str]:
    m = section(value, "model", MODEL)
    check(m["seed"], "model.seed", int, "an int")
    choice(m["attn_implementation"], "model.attn_implementation", ("sdpa", "eager"))
    kw = {"seed": m["seed"], "attn_implementation": m["attn_implementation"]}
    path = m["pretrained_path"]
    if path is not None:
        path = os.path.expanduser(str(path))
        if os.path.isfile(os.path.join(path, "config.json")):
            with at("model.pretrained_path"):
                return HFModelSpec(pretrained_path=path, **kw), f"pretrained weights from {path}"
        if for_training or m["config"] is None:
            fail(
                f"model.pretrained_path={path!r}: no config.json there; point it at a local "
                "save_pretrained directory (override model.pretrained_path=/path/to/model)"
                + ("." if for_training else " or give an inline model.config for `plan`.")
            )
    if m["config"] is None:
        fail("model: give pretrained_path (local weights) or config (preset name or HF dict).")
    with at("model.config"):
        spec = HFModelSpec(config=_model_config(m["config"], "model.config"), **kw)
    if path is None:
        return spec, "config (random init)"
    return spec, f"inline config: pretrained_path {path} is not on this machine (not checked)"


def _parallelism(value, path: str):
    if value is None or value in ("none", "data"):
        return DataParallel()
    if not isinstance(value, dict) or value.get("type") not in PARALLELISM:
        fail(
            f"{path}={value!r}: must be 'none' or a mapping with type one of "
            f"{list(PARALLELISM)}, e.g. {{type: sequence, size: 4}}."
        )
    cls, keys = PARALLELISM[value["type"]]
    kw = section({k: v for k, v in value.items() if k != "type"}, path, dict.fromkeys(keys))
    kw = {k: v for k, v in kw.items() if v is not None or k == "size"}
    if "size" in keys and kw["size"] is None:
        fail(f"{path}: type {value['type']!r} needs size (an int >= 1).")
    with at(path):
        return cls(**kw)


def _group(name: str, value) -> ModuleGroup:
    p = f"groups.{name}"
    g = section(value, p, GROUP)
    check(g["num_workers"], f"{p}.num_workers", int, "an int >= 1")
    check(g["use_gpu"], f"{p}.use_gpu", bool, "true or false")
    res = g["resources_per_worker"]
    if res is not None and not (
        isinstance(res, dict) and all(isinstance(v, int | float) for v in res.values())
    ):
        fail(f"{p}.resources_per_worker={res!r}: must be a mapping like {{CPU: 1, GPU: 0.5}}.")
    choice(g["placement_strategy"], f"{p}.placement_strategy", STRATEGIES)
    for key in ("activation_checkpointing", "trainable", "standby"):
        check(g[key], f"{p}.{key}", bool, "true or false")
    with at(p):
        scaling = ScalingConfig(
            num_workers=g["num_workers"],
            use_gpu=g["use_gpu"],
            resources_per_worker=res,
            placement_strategy=g["placement_strategy"],
        )
        return ModuleGroup(
            scaling_config=scaling,
            parallelism=_parallelism(g["parallelism"], f"{p}.parallelism"),
            activation_checkpointing=g["activation_checkpointing"],
            trainable=g["trainable"],
            freeze=g["freeze"] or (),
            lr_multiplier=g["lr_multiplier"],
            standby=g["standby"],
        )


def _run_config(value, name: str) -> RunConfig:
    r = section(value, "run_config", RUN)
    c = section(r["checkpoint"], "run_config.checkpoint", CHECKPOINT)
    choice(c["order"], "run_config.checkpoint.order", ("max", "min"))
    check(r["max_failures"], "run_config.max_failures", int, "an int (-1: retry forever)")
    storage = r["storage_path"]
    if storage is not None and "://" not in str(storage):
        storage = os.path.abspath(os.path.expanduser(str(storage)))
    with at("run_config"):
        return RunConfig(
            name=str(r["name"] or name),
            storage_path=storage,
            failure_config=FailureConfig(max_failures=r["max_failures"]),
            checkpoint_config=CheckpointConfig(
                num_to_keep=c["num_to_keep"],
                checkpoint_score_attribute=c["score_attribute"],
                checkpoint_score_order=c["order"],
            ),
        )


def _plan(value, data: dict) -> dict:
    """Defaults: the digits' image size (else 448 x 448), one image per sample."""
    p = section(value, "plan", PLAN)
    size = p["image_size"]
    if size is None:
        train = data["train"]
        size = train["image_size"] if train["type"] == "digits" else 448
    if isinstance(size, int):
        size = [size, size]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) for s in size)):
        fail(f"plan.image_size={size!r}: must be [height, width] in pixels (or one int).")
    check(p["images_per_sample"], "plan.images_per_sample", int, "an int >= 0")
    if p["seq_len"] is not None:
        check(p["seq_len"], "plan.seq_len", int, "an int (LLM tokens per sample)")
    return {**p, "image_size": size}


def load_recipe(source, overrides=(), *, for_training: bool = False) -> Recipe:
    """Read a recipe (a path, a bundled recipe's name, or a dict), apply ``overrides`` and
    check it as ``DisaggregatedTrainer`` does on the driver (no Ray, no worker).

    ``for_training``: ``model.pretrained_path`` must exist (``plan`` falls back to the
    inline ``model.config``) and weights are left for the trainer to check."""
    name, raw = _read(source)
    raw = apply_overrides(raw, overrides)
    top = section(raw, "recipe", TOP)
    model, model_source = _model(top["model"], for_training)
    adapter = model.adapter
    groups_raw = top["groups"]
    if not isinstance(groups_raw, dict):
        fail(f"groups: must be a mapping over the model's parts {list(adapter.parts)}.")
    unknown = sorted(set(groups_raw) - set(adapter.parts))
    if unknown:
        fail(
            f"groups: unknown group(s) {unknown}; {adapter.model_type} has groups "
            f"{list(adapter.parts)}."
        )
    groups = {n: _group(n, v) for n, v in groups_raw.items()}
    data = section(top["data"], "data", {"train": REQUIRED, "validation": None})
    data = {k: parse_data(v, f"data.{k}") for k, v in data.items() if v is not None}
    check(top["wait_for_resources"], "wait_for_resources", bool, "true or false")
    with at("train_loop_config"):
        loop = TrainLoopConfig.from_any(top["train_loop_config"])
    recipe = Recipe(
        name=name,
        model=model,
        model_source=model_source,
        groups=groups,
        loop=loop,
        placement=choice(top["placement"], "placement", ("separate", "colocated")),
        transfer=top["transfer"],
        wait_for_resources=top["wait_for_resources"],
        data=data,
        run_config=_run_config(top["run_config"], name),
        plan=_plan(top["plan"], data),
        raw=raw,
    )
    if "validation" not in data:
        if loop.eval_every is not None:
            fail("train_loop_config.eval_every: needs data.validation (or eval_every=null).")
        if recipe.run_config.checkpoint_config.checkpoint_score_attribute == "val_loss":
            fail("run_config.checkpoint.score_attribute='val_loss': needs data.validation.")
    _check_layout(recipe, check_weights=not for_training)
    return recipe


def _check_layout(r: Recipe, check_weights: bool) -> None:
    """The driver-side checks of ``DisaggregatedTrainer.__init__`` that need no data."""
    from ray_disagg.freezing import frozen_parts
    from ray_disagg.launch.checks import (
        validate_groups,
        validate_layout,
        validate_loop,
        validate_transfer,
    )
    from ray_disagg.launch.resources import colocation_for
    from ray_disagg.transport import TIERS

    with at("groups"):
        r.groups = validate_groups(r.groups, r.model.adapter)
    with at("placement"):
        colocation_for(r.groups, r.placement)
    choice(r.transfer, "transfer", ("auto", *TIERS))
    with at("transfer"):
        validate_transfer(r.transfer, r.groups)
    with at("groups"):
        validate_layout(r.model.adapter, r.groups)
        frozen_parts(r.model, r.groups)
    with at("loop"):
        validate_loop(r.model.adapter, r.loop)
    if check_weights:
        with at("model.pretrained_path"):
            r.model.check_weights()


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
    )
