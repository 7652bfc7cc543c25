"""Tier 2 (the groups' workers without Ray, ``testing.local``): non-finite steps. With
``skip_nonfinite_steps`` a step whose loss or gradients are not finite is never applied,
a batch without a label token is skipped, and every step is in the run's history; without
it, the run fails naming the group, the rank and the samples. (The same failure on Ray,
reaching the driver as ``TrainingFailedError``: ``tests/ray/test_reliability.py``.)"""

import math

import pytest
import torch
from ray.train import Checkpoint

from ray_disagg import load_metrics
from tests.helpers import NONFINITE_LOOP as LOOP
from tests.helpers import checkpoint_state, group, nonfinite_setup, run_layout, vt


@pytest.fixture(scope="module")
def setup():
    return nonfinite_setup()


def test_local_runner_names_the_failed_worker(setup, tmp_path):
    """An error naming group and rank, and the step's loss."""
    spec, data = setup
    with pytest.raises(RuntimeError, match=r"(?s)\[text group rank 0 failed\].*step 2: loss nan"):
        run_layout(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "nan", local=True)


def test_skipped_steps_history_and_finite_checkpoints(setup, tmp_path):
    spec, data = setup
    loop = dict(LOOP, skip_nonfinite_steps=True, checkpoint_every=1)
    result = run_layout(spec, data, loop, vt(group(2), group(1)), tmp_path, "skip", local=True)
    history = load_metrics(result)  # every reported step, not only the checkpointed ones
    assert history["step"].tolist() == [1, 2, 3]
    assert math.isfinite(history["loss"][0]) and math.isnan(history["loss"][2])
    assert history["skipped_steps"].tolist() == [0, 1, 2]
    assert history["label_tokens"][2] == 0  # reported as NaN, never as 0.0
    state = checkpoint_state(result.checkpoint)
    assert all(torch.isfinite(t).all() for t in state.values())
    after_step_1 = checkpoint_state(
        Checkpoint.from_directory(str(tmp_path / "skip" / "checkpoint_000001"))
    )
    assert all(torch.equal(state[k], after_step_1[k]) for k in state)  # 2 and 3 not applied
