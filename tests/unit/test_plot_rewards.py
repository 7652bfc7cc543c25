"""Tier 1: ``ray-disagg plot`` (``plot_run``) draws TRL's reward curves of a DPO run (the
implicit rewards and margin over a panel of the pairs' accuracy) and of a GRPO run (the
mean reward in its ``reward_std`` band, each function's mean, ``eval_reward``) from the
names the objectives report, and no reward picture for an SFT run."""

import json
import math

import pytest
from matplotlib.image import imread

from ray_disagg import DPO, GRPO
from ray_disagg.plotting import plot_run
from ray_disagg.run_files import METRICS_FILE


def exact(prompts, completions, **kw):
    return [1.0 for _ in completions]


def short(prompts, completions, **kw):
    return [0.5 for _ in completions]


def _run(tmp_path, name: str, names: tuple[str, ...]) -> str:
    """A run directory whose history reports ``names`` (and ``loss``) for 5 steps, values
    in (0, 1); ``eval_reward`` only every other step, as validation does."""
    run = tmp_path / name
    run.mkdir()
    with open(run / METRICS_FILE, "w") as f:
        for step in range(1, 6):
            row = {"step": step, "loss": 1.0 / step}
            row |= {k: 0.5 + 0.4 * math.sin(step + i) for i, k in enumerate(names)}
            if "eval_reward" in names and step % 2:
                del row["eval_reward"]
            f.write(json.dumps(row) + "\n")
    return str(run)


SFT: tuple[str, ...] = ()
DPO_NAMES = DPO.metric_names
GRPO_NAMES = (*GRPO(reward_funcs=[exact, short]).step_metric_names, "eval_reward")


@pytest.mark.parametrize(
    "name,names,height",
    [("dpo", DPO_NAMES, 660), ("grpo", GRPO_NAMES, 480), ("sft", SFT, None)],
)
def test_plot_draws_the_reward_curves_of_dpo_and_grpo_runs(tmp_path, name, names, height):
    assert {"rewards/chosen", "rewards/margins", "rewards/accuracies"} <= set(DPO_NAMES)
    assert {"reward", "reward_std", "rewards/exact/mean"} <= set(GRPO_NAMES)
    out = tmp_path / "pictures"
    paths = plot_run(_run(tmp_path, name, names), str(out))
    drawn = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert sorted(f.name for f in out.iterdir()) == drawn
    if height is None:  # SFT: no reward metric, no reward picture
        assert drawn == ["loss_curve.png"]
        return
    assert drawn == ["loss_curve.png", "reward_curve.png"]
    # DPO's two panels are a taller figure than GRPO's one (5.5 and 4 inches at 120 dpi)
    assert imread(out / "reward_curve.png").shape[:2] == (height, 960)
