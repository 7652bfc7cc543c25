"""Tier 3: ``examples/grpo_tiny_vlm.py``'s short version on a real Ray cluster (no SFT
stage: one fit): GRPO from a saved model and tokenizer, generating its completions on
the training groups with the rewards on the LLM group's leader, the HF export, the
models' greedy accuracy, and ``ray-disagg plot``'s reward curve (``reward_workers``' Ray
tasks run in the gloo tier's local runner only: ``tests/gloo/test_grpo_rollouts.py``). (The full
run's 20-point gain is measured by hand: the numbers are in the script's docstring.)"""

import importlib.util
import tempfile
from pathlib import Path

from ray_disagg import load_metrics
from ray_disagg.plotting import plot_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny_vlm.py"


def test_the_learning_example_runs_on_ray(ray_start_4_cpus, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("grpo_tiny_vlm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its runs and exports
    short = ["--sft-steps", "0", "--grpo-steps", "1", "--batch-size", "4",
             "--generations", "2", "--held-out", "4", "--train-images", "4",
             "--skip-check"]  # fmt: skip
    before, after, result = example.main(short)
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    frame = load_metrics(result)
    assert frame["step"].tolist() == [1]
    assert (frame["rollout_s"] > 0).all() and frame["reward"].between(0, 1).all()
    assert (frame["completions/max_length"] <= 2).all()
    paths = plot_run(result.path, str(tmp_path / "plots"))
    assert any(p.endswith("reward_curve.png") for p in paths)
