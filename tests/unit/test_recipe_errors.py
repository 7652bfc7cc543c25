"""Tier 1 (unit, no Ray): a run's refusals reported together, a recipe's in its own words
(key paths and YAML) and before Ray starts; the warnings of settings that cannot do what
they say; ``plan`` of a DPO recipe counts its reference copy and its pairs."""

import re
import warnings

import pytest
from ray.train import ScalingConfig

from ray_disagg import DPO, DisaggregatedTrainer, HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
from ray_disagg.config.refusals import RunRefused
from ray_disagg.config.run_warnings import RunWarning
from ray_disagg.data.examples import digits_samples
from ray_disagg.planner.cost import model_facts, passes
from ray_disagg.planner.memory import estimate
from ray_disagg.planner.render import render
from ray_disagg.recipes import cli
from ray_disagg.recipes.recipe import RecipeError, load_recipe

PYTHON_WORDS = r"\w\[['\"]|\w+Parallel\(|ScalingConfig\(|HFModelSpec\(|datasets|=True|=False"
ONE = {"num_workers": 1}


def _recipe(**changes) -> dict:
    """A DPO recipe on preference records (``plan`` reads no file)."""
    pairs = {"type": "preference", "records": "/data/pairs.jsonl", "tokenizer": "/models/tok"}
    recipe = {
        "model": {"config": "tiny_qwen2_5_vl"},
        "data": {"train": pairs},
        "groups": {"vision": dict(ONE), "text": dict(ONE)},
        "train_loop_config": {"max_steps": 4, "global_batch_size": 2, "objective": {"type": "dpo"}},
    }
    for key, value in changes.items():
        *path, last = key.split(".")
        node = recipe
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return recipe


def test_a_recipe_gets_every_independent_refusal_at_once_in_its_own_words():
    recipe = _recipe(**{
        "data.validation": {"type": "preference", "records": "/data/val.jsonl",
                            "tokenizer": "/models/tok"},
        "train_loop_config.eval_every": 2,
        "run_config.checkpoint": {"score_attribute": "val_loss"},
        "transfer": "nccl",
    })  # fmt: skip
    with pytest.raises(RecipeError) as refused:
        load_recipe(recipe)
    text = str(refused.value)
    assert text.startswith("recipe recipe: 4 settings to change:\n"), text
    for fix in ("set data.validation: null", "set train_loop_config.eval_every: null",
                "run_config.checkpoint.score_attribute: null", "transfer='auto'"):  # fmt: skip
        assert fix in text, fix
    assert not re.search(PYTHON_WORDS, text), text

    tp2 = {"num_workers": 1, "parallelism": {"type": "tensor", "size": 2}}
    sections = _recipe(**{"groups.text": tp2, "placement": "nowhere", "train_loop_config.lr": -1})
    with pytest.raises(RecipeError, match=r"3 settings to change") as refused:
        load_recipe(sections)
    assert "{type: tensor, size: 2}" in str(refused.value)
    assert not re.search(PYTHON_WORDS, str(refused.value)), str(refused.value)


def test_the_trainer_reports_independent_refusals_together_in_python():
    samples = digits_samples(tiny_qwen2_5_vl_config(), n=4, image_size=16)
    group = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    with pytest.raises(RunRefused) as refused:
        DisaggregatedTrainer(
            model=HFModelSpec(config=tiny_qwen2_5_vl_config()),
            groups={"vision": group, "text": group},
            train_loop_config={"max_steps": 2, "global_batch_size": 2, "eval_every": 1},
            datasets={"train": samples},
            transfer="nccl",
        )
    assert len(refused.value.errors) == 2
    assert "train_loop_config['eval_every']" in str(refused.value)
    assert "transfer='nccl'" in str(refused.value)


def test_a_missing_tokenizer_stops_plan_and_train_before_ray(monkeypatch, capsys, tmp_path):
    import yaml

    path = tmp_path / "dpo.yaml"
    recipe = _recipe()
    del recipe["data"]["train"]["tokenizer"]
    path.write_text(yaml.safe_dump(recipe))

    def no_ray(_groups):
        raise AssertionError("ray-disagg train started Ray before refusing the run")

    monkeypatch.setattr(cli, "_ensure_ray", no_ray)
    for command in ("plan", "train"):
        with pytest.raises(SystemExit):
            cli.main([command, str(path)])
        assert "data.train.tokenizer: required" in capsys.readouterr().err, command


def test_settings_that_cannot_do_what_they_say_are_warned_about():
    loop = {"warmup_steps": 8, "checkpoint_every": 10, "trace_steps": [2]}
    plan = render(load_recipe(_recipe(**{f"train_loop_config.{k}": v for k, v in loop.items()})))
    warned = plan.split("warnings:\n")[1]
    assert "train_loop_config.warmup_steps=8 is not shorter than" in warned
    assert "train_loop_config.checkpoint_every=10 is beyond train_loop_config.max_steps=4" in warned
    assert "trace_steps" not in warned
    samples = digits_samples(tiny_qwen2_5_vl_config(), n=4, image_size=16)
    group = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DisaggregatedTrainer(
            model=HFModelSpec(config=tiny_qwen2_5_vl_config()),
            groups={"vision": group, "text": group},
            train_loop_config={"max_steps": 2, "global_batch_size": 2, "warmup_steps": 2},
            datasets={"train": samples},
        )
    said = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    assert len(said) == 1 and "the lr never reaches" in said[0], said


def test_plan_counts_dpo_reference_copy_and_pairs():
    dpo = load_recipe(_recipe())
    sft = load_recipe(_recipe(**{"train_loop_config.objective": None,
                                 "data.train": {"type": "digits", "num_samples": 8}}))  # fmt: skip
    sft.plan = dpo.plan  # the same sequences
    dpo_memory, sft_memory = estimate(dpo), estimate(sft)
    for part in ("vision", "text"):
        assert dpo_memory[part].reference == dpo_memory[part].params > 0
        assert sft_memory[part].reference == 0
        assert passes(dpo, part, model_facts(dpo)) == passes(sft, part, model_facts(sft)) + 1
    assert dpo_memory["text"].activations == pytest.approx(2 * sft_memory["text"].activations)
    assert dpo_memory["vision"].activations == sft_memory["vision"].activations
    text = render(dpo)
    assert "objective: DPO: 2 sequence(s)" in text and "reference copy" in text
    assert re.search(r"optimizer\s+reference\s+activations", text)
    lora = load_recipe(
        _recipe(
            **{
                "groups.text.lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
                "groups.vision.trainable": False,
            }
        )
    )
    assert estimate(lora)["text"].reference == 0  # "auto": the adapters off
    assert "reference adapters_disabled" in render(lora)
    assert DPO().reference == "auto"


def test_train_checks_the_samples_before_ray_in_the_recipes_words(monkeypatch, capsys):
    def no_ray(_groups):
        raise AssertionError("ray-disagg train started Ray before checking the samples")

    monkeypatch.setattr(cli, "_ensure_ray", no_ray)
    packed = ["train_loop_config.pack_sequences=true", "train_loop_config.max_seq_len=8"]
    with pytest.raises(SystemExit):
        cli.main(["train", "digits_cpu", *packed])
    said = capsys.readouterr().err
    assert said.startswith("ray-disagg: error: recipe digits_cpu: ") and "sample" in said, said
    assert "train_loop_config.max_seq_len" in said and not re.search(PYTHON_WORDS, said), said
