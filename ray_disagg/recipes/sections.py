"""The sections of a recipe (``model``, ``groups``, ``run_config``, ``plan``): their
schemas, whose defaults for our own settings come from the settings' declarations (the
trainer's keyword arguments, ``HFModelSpec``, ``ModuleGroup``, the parallelism classes;
Ray's ``ScalingConfig`` and ``RunConfig`` keys keep Ray's), and each section's parser."""

from __future__ import annotations

import dataclasses
import inspect
import os

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from ray_disagg import models
from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.config.settings import defaults
from ray_disagg.model import HFModelSpec
from ray_disagg.recipes.schema import REQUIRED, at, check, choice, fail, section
from ray_disagg.trainer import DisaggregatedTrainer

__all__ = [
    "GROUP",
    "MODEL",
    "PARALLELISM",
    "SCALING",
    "TOP",
    "group_section",
    "model_section",
    "plan_section",
    "run_config_section",
]

# The defaults of our own settings come from their declarations (the trainer's keyword
# arguments, HFModelSpec, ModuleGroup, the parallelism classes); those of Ray's
# ScalingConfig keys are Ray's.
_TRAINER = inspect.signature(DisaggregatedTrainer.__init__).parameters
TOP = {
    "model": REQUIRED,
    "data": REQUIRED,
    "groups": REQUIRED,
    "train_loop_config": REQUIRED,
    **{k: _TRAINER[k].default for k in ("placement", "transfer", "wait_for_resources")},
    "run_config": None,
    "plan": None,
}
MODEL = {
    "pretrained_path": None,
    "config": None,
    "build_if_missing": False,
    "peft_path": None,
    **defaults(HFModelSpec, ("seed", "attn_implementation")),
}
MODEL_HELP = {
    "pretrained_path": "a local `save_pretrained` directory: weights, config, tokenizer, "
    "processors",
    "config": "a `tiny_*` preset, `{preset: NAME, **kwargs}` or an HF config dict with "
    "`model_type`: random init (without `pretrained_path`)",
    "build_if_missing": "build a complete tiny model directory of `config` at "
    "`pretrained_path` when none is there (random weights from `seed`, a tokenizer with "
    "the family's chat template, its image processor, example records in `examples/`; "
    "`plan` and `train` build it, no download)",
    "peft_path": "a saved PEFT adapter directory to start from",
    "seed": "the random init's seed",
    "attn_implementation": "`sdpa` or `eager`",
}
"""What each model key is (the recipe reference, ``ray_disagg.recipes.reference``)."""
SCALING = {  # Ray's ScalingConfig keys a recipe sets, with Ray's defaults
    "num_workers": 1,
    "use_gpu": False,
    "resources_per_worker": None,
    "placement_strategy": "PACK",
}
# peft_config (a peft.LoraConfig object) is written as `lora` (LORA's keys)
GROUP = {**SCALING, **{k: v for k, v in defaults(ModuleGroup).items() if k != "peft_config"}}
GROUP["lora"] = None
LORA = {  # recipe key -> LoraConfig field, PEFT's defaults
    "r": ("r", 8),
    "alpha": ("lora_alpha", 8),
    "dropout": ("lora_dropout", 0.0),
    "target_modules": ("target_modules", None),
    "modules_to_save": ("modules_to_save", None),
    "use_rslora": ("use_rslora", False),
    "init": ("init_lora_weights", True),
}
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PARALLELISM = {  # type -> (class, allowed keys: the class's fields)
    "none": (DataParallel, ()),
    **{
        name: (cls, tuple(f.name for f in dataclasses.fields(cls)))
        for name, cls in (
            ("data", DataParallel),
            ("sequence", SequenceParallel),
            ("tensor", TensorParallel),
            ("context", ContextParallel),
            ("expert", ExpertParallel),
        )
    },
}
RUN = {"name": None, "storage_path": None, "max_failures": 0, "checkpoint": None,
       "report_to": None}  # fmt: skip
CHECKPOINT = {"num_to_keep": None, "score_attribute": None, "order": "max"}
PLAN = {"image_size": None, "images_per_sample": 1, "seq_len": None}


def model_config(cfg, path: str):
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


def model_section(value, for_training: bool) -> tuple[HFModelSpec, str]:
    m = section(value, "model", MODEL)
    choice(m["attn_implementation"], "model.attn_implementation", ("sdpa", "eager"))
    kw = {"seed": m["seed"], "attn_implementation": m["attn_implementation"]}
    if m["peft_path"] is not None:
        kw["peft_path"] = os.path.expanduser(str(m["peft_path"]))
    path = m["pretrained_path"]
    if m["build_if_missing"] and path is None:
        fail("model.build_if_missing: needs model.pretrained_path, where to build the model.")
    if path is not None:
        path = os.path.expanduser(str(path))
        if m["build_if_missing"]:
            _build_tiny(path, m)
        if os.path.isfile(os.path.join(path, "config.json")):
            with at("model"):
                return HFModelSpec(pretrained_path=path, **kw), f"pretrained weights from {path}"
        if for_training or m["config"] is None:
            fail(
                f"model.pretrained_path={path!r}: no config.json there; point it at a local "
                "save_pretrained directory (override model.pretrained_path=/path/to/model)"
                + ("." if for_training else " or give an inline model.config for `plan`.")
            )
    if m["config"] is None:
        fail("model: give pretrained_path (local weights) or config (preset name or HF dict).")
    config = model_config(m["config"], "model.config")
    with at("model"):
        spec = HFModelSpec(config=config, **kw)
    if path is None:
        return spec, "config (random init)"
    return spec, f"inline config: pretrained_path {path} is not on this machine (not checked)"


def _build_tiny(path: str, m: dict) -> None:
    """``model.build_if_missing``: a complete tiny model directory of ``model.config``
    written at ``path`` unless one is there (:func:`ray_disagg.data.tiny_model.save_tiny_model`)."""
    check(m["build_if_missing"], "model.build_if_missing", bool, "true or false")
    preset = m["config"].get("preset") if isinstance(m["config"], dict) else m["config"]
    if not isinstance(preset, str):
        fail(
            "model.build_if_missing: needs model.config to be a tiny_* preset (or {preset: "
            "NAME, ...}), the model to build at model.pretrained_path."
        )
    has_model = os.path.isfile(os.path.join(path, "config.json"))
    if not has_model and os.path.isdir(path) and os.listdir(path):
        fail(
            f"model.pretrained_path={path!r}: neither a model directory (no config.json) nor "
            "empty, so model.build_if_missing cannot build there; give a new or empty path."
        )
    from ray_disagg.data.tiny_model import save_tiny_model

    config = model_config(m["config"], "model.config")
    try:
        with at("model.build_if_missing"):
            save_tiny_model(path, config, seed=m["seed"])
    except ImportError as e:
        fail(
            f"model.build_if_missing: {e}; building the tiny model needs scikit-learn and "
            "Pillow (pip install scikit-learn pillow, or `make install`)."
        )
    except NotImplementedError as e:
        fail(f"model.build_if_missing: {e}")


def parallelism_section(value, path: str):
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


def group_section(name: str, value) -> ModuleGroup:
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
    with at(p):
        scaling = ScalingConfig(
            num_workers=g["num_workers"],
            use_gpu=g["use_gpu"],
            resources_per_worker=res,
            placement_strategy=g["placement_strategy"],
        )
        return ModuleGroup(
            scaling_config=scaling,
            parallelism=parallelism_section(g["parallelism"], f"{p}.parallelism"),
            activation_checkpointing=g["activation_checkpointing"],
            trainable=g["trainable"],
            freeze=g["freeze"] or (),
            lr_multiplier=g["lr_multiplier"],
            standby=g["standby"],
            peft_config=lora_section(g["lora"], f"{p}.lora"),
        )


def lora_section(value, path: str):
    """``groups.<part>.lora``: a ``peft.LoraConfig`` (``None``: full fine-tuning)."""
    if value is None:
        return None
    lora = section(value, path, {k: d for k, (_, d) in LORA.items()})
    if lora["target_modules"] is None:
        fail(f"{path}.target_modules: name the modules to adapt, e.g. [q_proj, v_proj].")
    from ray_disagg.lora.layers import require_peft

    with at(path):
        return require_peft().LoraConfig(**{LORA[k][0]: v for k, v in lora.items()})


def report_to_section(value) -> tuple[str, ...]:
    """``run_config.report_to``: the experiment trackers (names checked here; their
    packages by the trainer)."""
    from ray_disagg.launch.trackers import TRACKERS

    names = (value or {}).get("report_to") if isinstance(value, dict) else None
    names = [names] if isinstance(names, str) else names or []
    if not isinstance(names, list):
        fail(f"run_config.report_to={names!r}: must be a list of {list(TRACKERS)}.")
    for k, name in enumerate(names):
        choice(name, f"run_config.report_to[{k}]", TRACKERS)
    return tuple(names)


def run_config_section(value, name: str) -> RunConfig:
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


def plan_section(value, data: dict) -> dict:
    """Defaults: the digits' image size (else 448 x 448), one image per sample."""
    p = section(value, "plan", PLAN)
    size = p["image_size"]
    if size is None:
        train = data["train"]
        train = train["sources"][0] if train["type"] == "mixture" else train
        size = train["image_size"] if train["type"] == "digits" else 448
    if isinstance(size, int):
        size = [size, size]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) for s in size)):
        fail(f"plan.image_size={size!r}: must be [height, width] in pixels (or one int).")
    check(p["images_per_sample"], "plan.images_per_sample", int, "an int >= 0")
    if p["seq_len"] is not None:
        check(p["seq_len"], "plan.seq_len", int, "an int (LLM tokens per sample)")
    return {**p, "image_size": size}
