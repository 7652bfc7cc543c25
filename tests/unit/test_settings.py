"""Tier 1 (unit): the declared settings of the config classes (``ray_disagg.config.settings``):
one check loop over the declarations, bools refused where numbers are meant, numpy
numbers taken, a YAML ``1e3`` refused for an int with the fix, and the recipe schema's
defaults read from the same declarations."""

import dataclasses
import typing

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import DPO, HFModelSpec, ModuleGroup, TrainLoopConfig, tiny_qwen2_5_vl_config
from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.config.settings import choices, defaults
from ray_disagg.recipes import recipe, sections

LOOP = {"max_steps": 2, "global_batch_size": 2}
DECLARED = (
    TrainLoopConfig,
    ModuleGroup,
    HFModelSpec,
    DataParallel,
    SequenceParallel,
    TensorParallel,
    ContextParallel,
    ExpertParallel,
    DPO,
)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_steps", True, r"\['max_steps'\]=True: must be an int >= 1 \(a bool is not"),
        ("micro_batches", True, r"\['micro_batches'\]=True: must be an int >= 1"),
        ("bf16", "yes", r"\['bf16'\]='yes': must be True or False"),
        ("shuffle", "no", r"\['shuffle'\]='no': must be True or False"),
        ("seed", "x", r"\['seed'\]='x': must be an int\."),
        ("max_steps", 1e3, r"=1000.0: must be an int >= 1; write 1000 \(an int, not a float\)"),
        ("lr", False, r"\['lr'\]=False: must be a finite float > 0"),
        ("lr", float("nan"), r"\['lr'\]=nan: must be a finite float > 0"),
        ("min_lr_ratio", 1.5, r"must be a finite float in \[0, 1\]"),
        ("betas", (0.9, 1.0), r"must be two floats in \[0, 1\)"),
        ("betas", (0.9,), r"must be two floats in \[0, 1\)"),
        ("max_grad_norm", 0, r"must be None or a finite float > 0"),
        ("checkpoint_every", 0, r"must be None or an int >= 1"),
        ("lr_schedule", "step", r"must be one of \('constant', 'linear', 'cosine'\)"),
        ("schedule", "gpipe", r"must be None or one of \('sequential', '1f1b'\)"),
        ("param_dtype", "float16", r"must be one of \('float32', 'bfloat16'\)"),
        ("extra", [], r"\['extra'\]=\[\]: must be a dict"),
    ],
)
def test_the_loop_config_refuses(key, value, message):
    with pytest.raises(ValueError, match=message):
        TrainLoopConfig(**{**LOOP, key: value})


def test_numbers_are_normalized():
    cfg = TrainLoopConfig(
        max_steps=np.int64(3), global_batch_size=2, lr=1, betas=[0.8, np.float32(0.9)]
    )
    assert type(cfg.max_steps) is int and cfg.max_steps == 3
    assert type(cfg.lr) is float and cfg.lr == 1.0
    assert cfg.betas == (0.8, pytest.approx(0.9)) and isinstance(cfg.betas, tuple)
    group = ModuleGroup(scaling_config=ScalingConfig(num_workers=1), freeze="model.visual")
    assert group.freeze == ("model.visual",)
    assert SequenceParallel(size=np.int32(2)).size == 2
    flag = TrainLoopConfig(max_steps=2, global_batch_size=2, bf16=np.True_).bf16
    assert flag is True  # a numpy bool is taken as a Python one


def test_the_other_config_classes_refuse_by_their_declarations():
    sc = ScalingConfig(num_workers=2)
    cases = [
        (lambda: ModuleGroup(scaling_config=sc, trainable=1), r"trainable=1\): must be True"),
        (lambda: ModuleGroup(scaling_config=sc, lr_multiplier=True), r"lr_multiplier=True\)"),
        (lambda: ModuleGroup(scaling_config=sc, freeze=[""]), r"e\.g\. \['model\.visual"),
        (lambda: TensorParallel(size=2.0), r"TensorParallel\(size=2.0\): .* write 2"),
        (lambda: ContextParallel(size=2, tp=True), r"ContextParallel\(tp=True\)"),
        (lambda: ExpertParallel(size=2, fsdp="no"), r"ExpertParallel\(fsdp='no'\)"),
        (lambda: DataParallel(zero1=None), r"DataParallel\(zero1=None\): must be True"),
        (
            lambda: HFModelSpec(config=tiny_qwen2_5_vl_config(), attn_implementation=2),
            r"HFModelSpec\(attn_implementation=2\): must be a string",
        ),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()


def test_enum_fields_are_literals_and_every_field_is_declared():
    """The allowed values of an enum are its ``Literal`` (one declaration); every field of
    the config classes but the ones with explicit checks is declared."""
    assert choices(TrainLoopConfig, "schedule") == ("sequential", "1f1b")
    assert choices(TrainLoopConfig, "assignment") == ("auto", "contiguous", "balanced")
    explicit = {"scaling_config", "parallelism", "config", "pretrained_path"}
    explicit |= {"peft_config", "peft_path"}  # checked by ray_disagg.lora.layers
    explicit |= {"objective"}  # checked by ray_disagg.objectives (its own declared settings)
    for cls in DECLARED:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in explicit:
                assert "ray_disagg.setting" in f.metadata, (cls.__name__, f.name)
            if typing.get_origin(hints[f.name]) is typing.Literal:
                assert f.default in typing.get_args(hints[f.name])


def test_the_recipe_schema_takes_its_defaults_from_the_declarations():
    declared = {k: v for k, v in defaults(ModuleGroup).items() if k != "peft_config"}
    assert {k: sections.GROUP[k] for k in declared} == declared
    assert set(sections.GROUP) == set(sections.SCALING) | set(declared) | {"lora"}
    assert sections.MODEL["seed"] == 0 and sections.MODEL["attn_implementation"] == "sdpa"
    assert (sections.TOP["placement"], sections.TOP["transfer"]) == ("separate", "auto")
    assert sections.PARALLELISM["context"][1] == ("size", "tp", "fsdp")
    r = recipe.load_recipe("digits_cpu", ["groups.vision.lr_multiplier=0.5"])
    assert r.groups["vision"].lr_multiplier == 0.5 and r.groups["text"].trainable is True
    with pytest.raises(ValueError, match=r"max_steps(?:'\]|)=1000.0: .*write 1000"):
        recipe.load_recipe("digits_cpu", ["train_loop_config.max_steps=1e3"])
    with pytest.raises(ValueError, match=r"groups.vision: standby=maybe: must be true or false"):
        recipe.load_recipe("digits_cpu", ["groups.vision.standby=maybe"])
    with pytest.raises(ValueError, match=r"model.attn_implementation='flash'.*'sdpa', 'eager'"):
        recipe.load_recipe("digits_cpu", ["model.attn_implementation=flash"])


def test_trace_steps_are_steps_of_the_run():
    from ray_disagg import TrainLoopConfig

    cfg = TrainLoopConfig(max_steps=4, global_batch_size=1, trace_steps=[1, 4])
    assert cfg.trace_steps == (1, 4)
    with pytest.raises(ValueError, match=r"trace_steps'\]=\[0\]: must be a list of ints >= 1"):
        TrainLoopConfig(max_steps=4, global_batch_size=1, trace_steps=[0])
    with pytest.raises(ValueError, match=r"has \[5\], after the run's last step \(max_steps=4\)"):
        TrainLoopConfig(max_steps=4, global_batch_size=1, trace_steps=[2, 5])


def test_peak_tflops_is_a_positive_figure():
    assert TrainLoopConfig(max_steps=1, global_batch_size=1, peak_tflops=989.4).peak_tflops
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(
            ValueError, match=r"peak_tflops'\]=.*must be None or a finite float > 0"
        ):
            TrainLoopConfig(max_steps=1, global_batch_size=1, peak_tflops=bad)
