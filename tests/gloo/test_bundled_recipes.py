"""Tier 2: the bundled CPU recipes as written (their model section building the tiny
model directory, their data from its example records, their groups and loop) train a
step through the local runner's workers (the recipes' launch through ``ray-disagg
train`` on Ray is the same code path as ``digits_cpu``'s in ``tests/ray/test_cli.py``):
``sft_cpu`` trains both parts, ``lora_cpu`` saves the LLM's adapter alone, ``dpo_cpu``
reports TRL's reward metrics, ``grpo_cpu`` generates its completions and scores them
with ``digit_reward``."""

import math

import pytest

from ray_disagg import DisaggregatedTrainer
from ray_disagg.lora.layers import is_factor
from ray_disagg.recipes.recipe import load_recipe, trainer_kwargs
from ray_disagg.testing.local import fit_local
from tests.helpers import checkpoint_state

QUICK = [
    "train_loop_config.max_steps=1",
    "train_loop_config.global_batch_size=2",
    "train_loop_config.warmup_steps=0",
    "train_loop_config.checkpoint_every=1",
]


@pytest.mark.parametrize("recipe", ["sft_cpu", "lora_cpu", "dpo_cpu", "grpo_cpu"])
def test_a_bundled_cpu_recipe_trains_as_written(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the recipe's ~/.cache/ray_disagg/...
    batch = ["train_loop_config.global_batch_size=1"] if recipe == "grpo_cpu" else []
    argv = [*QUICK, *batch, f"run_config.storage_path={tmp_path / 'runs'}"]
    loaded = load_recipe(recipe, argv)
    assert (tmp_path / ".cache/ray_disagg/tiny_qwen2_5_vl/config.json").is_file()
    result = fit_local(DisaggregatedTrainer(**trainer_kwargs(loaded)))
    assert result.metrics["step"] == 1 and math.isfinite(result.metrics["loss"])
    text = [k for k in checkpoint_state(result.checkpoint) if not k.startswith("model.visual")]
    assert text and all(is_factor(k) for k in text) == (recipe == "lora_cpu")
    assert math.isfinite(result.metrics.get("rewards/margins", 0.0))
    assert ("rewards/margins" in result.metrics) == (recipe == "dpo_cpu")
    if recipe == "grpo_cpu":  # one prompt, four completions drawn and scored
        assert 0.0 <= result.metrics["rewards/digit_reward/mean"] <= 1.0
