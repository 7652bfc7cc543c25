"""Tier 3: the bundled DPO recipe runs as written with ``ray-disagg train dpo_cpu`` (a
step, on the shared Ray cluster): it builds its tiny model directory on first use (here
under a temporary ``HOME``), trains on its TRL preference pairs and reports TRL's reward
metrics. (``sft_cpu`` and ``lora_cpu`` run through the local runner:
``tests/gloo/test_bundled_recipes.py``.)"""

import math

from ray_disagg.recipes.cli import main

QUICK = [
    "train_loop_config.max_steps=1",
    "train_loop_config.global_batch_size=2",
    "groups.vision.resources_per_worker={CPU: 0.5}",
    "groups.text.resources_per_worker={CPU: 0.5}",
]


def test_the_bundled_dpo_recipe_trains_with_the_cli(ray_start_4_cpus, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the recipe's ~/.cache/ray_disagg/...
    result = main(["train", "dpo_cpu", *QUICK, f"run_config.storage_path={tmp_path}"])
    built = tmp_path / ".cache" / "ray_disagg" / "tiny_qwen2_5_vl"
    assert (built / "config.json").is_file() and (built / "examples" / "pairs.json").is_file()
    assert result.metrics["step"] == 1 and math.isfinite(result.metrics["loss"])
    assert math.isfinite(result.metrics["rewards/margins"])
