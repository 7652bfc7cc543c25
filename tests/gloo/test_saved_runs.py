"""Tier 2 (the workers without Ray): what a user of ray_disagg 0.1 saved keeps working.
``tests/fixtures/saved_run.py`` wrote the committed files of ``tests/fixtures/run_0_1/``:
its checkpoint resumes and continues as the uninterrupted run does, and a new run's
``metrics.jsonl`` and trace files keep the saved ones' format (every saved key, with its
type, and the same deterministic values; new keys may be added)."""

import json
import os

import pytest
import torch
from ray.train import Checkpoint

from ray_disagg import load_metrics
from tests.fixtures.saved_run import CHECKPOINT, FOLDER, LOOP, STEPS, spec_and_data
from tests.helpers import assert_params_close, checkpoint_state, group, losses, run_layout, vt

EXACT = ("step", "epoch", "samples", "sample_ids", "label_tokens", "images", "videos", "lr",
         "vision_lr", "text_lr", "skipped_steps", "vision_backward_passes",
         "text_backward_passes")  # fmt: skip
"""Metrics that depend neither on the CPU's rounding nor on the clock."""
CLOSE = {"loss": 1e-5, "grad_norm": 1e-4, "vision_grad_norm": 1e-4, "text_grad_norm": 1e-4}
"""Metrics equal within fp32 rounding (relative; the saved run ran on another CPU)."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The saved run's settings, uninterrupted for one more step."""
    spec, data = spec_and_data()
    tmp = tmp_path_factory.mktemp("straight")
    loop = dict(LOOP, max_steps=STEPS + 1)
    return run_layout(spec, data, loop, vt(group(1), group(1)), tmp, "straight", local=True)


def _lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kind(value) -> str:
    return type(value).__name__


def test_a_saved_checkpoint_resumes_like_the_uninterrupted_run(straight, tmp_path):
    spec, data = spec_and_data()
    loop = dict(LOOP, max_steps=STEPS + 1)
    resumed = run_layout(spec, data, loop, vt(group(1), group(1)), tmp_path, "resumed",
                         resume=Checkpoint(CHECKPOINT), local=True)  # fmt: skip
    got, want = load_metrics(resumed), load_metrics(straight)
    assert got["step"].tolist() == [STEPS + 1]  # the saved data position and step
    assert got["sample_ids"].tolist() == want["sample_ids"].tolist()[STEPS:]
    torch.testing.assert_close(losses(resumed), losses(straight)[STEPS:], rtol=1e-5, atol=0.0)
    assert_params_close(checkpoint_state(resumed.checkpoint), checkpoint_state(straight.checkpoint))


def test_metrics_and_trace_files_keep_their_format(straight):
    saved = _lines(os.path.join(FOLDER, "metrics.jsonl"))
    new = _lines(os.path.join(straight.path, "metrics.jsonl"))[:STEPS]
    assert len(saved) == STEPS and len(new) == STEPS
    for old, now in zip(saved, new):
        assert set(old) <= set(now), set(old) - set(now)
        assert {k: _kind(now[k]) for k in old} == {k: _kind(v) for k, v in old.items()}
        assert {k: now[k] for k in EXACT} == {k: old[k] for k in EXACT}
        for key, rel in CLOSE.items():
            assert now[key] == pytest.approx(old[key], rel=rel), key
    for name in ("vision", "text"):
        old_trace = _lines(os.path.join(FOLDER, "trace", f"{name}.jsonl"))
        new_trace = _lines(os.path.join(straight.path, "trace", f"{name}.jsonl"))
        assert [(x["step"], x["group"]) for x in new_trace] == [
            (x["step"], x["group"]) for x in old_trace
        ]
        for old, now in zip(old_trace, new_trace):
            assert set(now) == set(old)
            assert [a["action"] for a in now["actions"]] == [a["action"] for a in old["actions"]]
            kinds = [{k: _kind(v) for k, v in a.items()} for a in old["actions"]]
            assert [{k: _kind(v) for k, v in a.items()} for a in now["actions"]] == kinds
