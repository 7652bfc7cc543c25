"""Tier 1 (unit, no Ray): one resolution of a run (``ray_disagg.config.layout.resolve``).

``DisaggregatedTrainer(...)``, ``ray-disagg plan`` and ``ray-disagg train`` accept and
refuse the same layouts with the same message, and ``train`` refuses before it starts
Ray. (Checks that read the samples stay with the trainer and are not in the table.)"""

import re

import pytest
import yaml
from ray.train import ScalingConfig

from ray_disagg import DisaggregatedTrainer, HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
from ray_disagg.config.groups import ContextParallel, SequenceParallel, TensorParallel
from ray_disagg.config.layout import DataSpec, resolve
from ray_disagg.data.examples import digits_samples
from ray_disagg.recipes import cli
from ray_disagg.recipes.words import recipe_message

PARALLELISM = {"tensor": TensorParallel, "sequence": SequenceParallel, "context": ContextParallel}
ONE = {"num_workers": 1}

# (case, vision group, text group, loop settings, top-level settings, message)
BAD = [
    (
        "standby without checkpoints",
        {**ONE, "standby": True},
        ONE,
        {},
        {},
        "ModuleGroup(standby=True) on the 'vision' group: a restart continues from a "
        "checkpoint: set checkpoint_every.",
    ),
    (
        "standby on the LLM group",
        ONE,
        {**ONE, "standby": True},
        {"checkpoint_every": 2},
        {},
        "ModuleGroup(standby=True) on the 'text' group: it cannot restart alone here",
    ),
    (
        "tensor parallel degree not dividing the heads",
        ONE,
        {"num_workers": 3, "parallelism": {"type": "tensor", "size": 3}},
        {},
        {},
        "TensorParallel(size=3) in the text group does not divide",
    ),
    (
        "context parallel on the tower",
        {"num_workers": 2, "parallelism": {"type": "context", "size": 2}},
        ONE,
        {},
        {},
        "ContextParallel is not supported for the 'vision' group",
    ),
    ("nccl without GPUs", ONE, ONE, {}, {"transfer": "nccl"}, "transfer='nccl' moves tensors"),
    (
        "colocated on different devices",
        {**ONE, "use_gpu": True},
        ONE,
        {},
        {"placement": "colocated"},
        "placement='colocated' needs every group on the same devices",
    ),
    (
        "a freeze prefix matching nothing",
        {**ONE, "freeze": ["model.visual.nothing"]},
        ONE,
        {},
        {},
        "groups['vision'].freeze: 'model.visual.nothing' matches none",
    ),
    (
        "eval_every without a validation set",
        ONE,
        ONE,
        {"eval_every": 2},
        {},
        "train_loop_config['eval_every'] is set but there is no validation set",
    ),
]
LOOP = {"max_steps": 4, "global_batch_size": 2}


def _group(settings: dict) -> ModuleGroup:
    p = settings.get("parallelism", "none")
    if isinstance(p, dict):
        p = PARALLELISM[p["type"]](**{k: v for k, v in p.items() if k != "type"})
    sc = ScalingConfig(num_workers=settings["num_workers"], use_gpu=settings.get("use_gpu", False))
    return ModuleGroup(
        scaling_config=sc,
        parallelism=p,
        standby=settings.get("standby", False),
        freeze=settings.get("freeze", ()),
    )


def _recipe(tmp_path, vision, text, loop, top) -> str:
    recipe = {
        "model": {"config": "tiny_qwen2_5_vl"},
        "data": {"train": {"type": "digits", "num_samples": 8, "image_size": 16}},
        "groups": {"vision": vision, "text": text},
        "train_loop_config": {**LOOP, **loop},
        **top,
    }
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


PYTHON_WORDS = (
    r"\w\[['\"]|\w+Parallel\(|ModuleGroup\(|ScalingConfig\(|HFModelSpec\(|datasets|=True|=False"
)
"""Python's spellings of the trainer's settings, which a recipe's errors do not use."""


@pytest.fixture(scope="module")
def samples():
    return digits_samples(tiny_qwen2_5_vl_config(), n=8, image_size=16)


@pytest.mark.parametrize("case, vision, text, loop, top, message", BAD, ids=[b[0] for b in BAD])
def test_trainer_plan_and_train_refuse_alike(
    case, vision, text, loop, top, message, samples, tmp_path, monkeypatch, capsys
):
    with pytest.raises(ValueError) as refused:
        DisaggregatedTrainer(
            model=HFModelSpec(config=tiny_qwen2_5_vl_config()),
            groups={"vision": _group(vision), "text": _group(text)},
            train_loop_config={**LOOP, **loop},
            datasets={"train": samples},
            **top,
        )
    text_ = str(refused.value)
    assert message in text_
    path = _recipe(tmp_path, vision, text, loop, top)

    def no_ray(_groups):
        raise AssertionError("ray-disagg train started Ray before refusing the run")

    monkeypatch.setattr(cli, "_ensure_ray", no_ray)
    for command in ("plan", "train"):
        with pytest.raises(SystemExit) as stopped:
            cli.main([command, path])
        assert stopped.value.code == 2
        said = capsys.readouterr().err.strip()
        assert said == f"ray-disagg: error: {recipe_message('bad', refused.value)}", command
        assert not re.search(PYTHON_WORDS, said), said  # the recipe's own words


def test_resolve_fills_in_what_depends_on_the_run():
    model = HFModelSpec(config=tiny_qwen2_5_vl_config())
    groups = {"vision": _group(ONE), "text": _group(ONE)}
    loop = {**LOOP, "micro_batches": 2}
    separate = resolve(model, groups, loop, data=DataSpec(kind="map"))
    assert separate.loop.schedule == "1f1b" and separate.loop.assignment == "balanced"
    assert separate.restartable == frozenset({"vision"}) and separate.samples_validated
    streamed = resolve(model, groups, loop, data=DataSpec(kind="stream"))
    assert streamed.restartable == frozenset() and not streamed.samples_validated
    assert streamed.loop.assignment == "contiguous"
    colocated = resolve(model, groups, loop, placement="colocated", data=DataSpec())
    assert colocated.loop.schedule == "sequential" and colocated.colocation is not None
    assert list(colocated.groups) == ["vision", "text"]
    off = resolve(model, groups, loop, restart_failed_group=False, data=DataSpec())
    assert off.restartable == frozenset()


def test_the_data_spec_of_datasets(samples):
    spec = DataSpec.of({"train": samples, "validation": samples})
    assert spec.kind == "map" and spec.validation and not spec.streamed
    with pytest.raises(ValueError, match="extra keys"):
        DataSpec.of({"train": samples, "test": samples})
