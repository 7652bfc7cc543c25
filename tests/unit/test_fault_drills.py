"""Tier 1 (unit; one plain subprocess): fault drills are armed only by the environment
variable RAY_DISAGG_FAULT_DRILL, which the driver hands to its workers; the previous
release's names are gone, and its options are refused naming their replacement."""

import json
import os
import subprocess
import sys

import pytest
from ray.train import RunConfig, ScalingConfig

import ray_disagg
from ray_disagg import (
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.launch import ray_compat as rc
from ray_disagg.testing import faults
from ray_disagg.worker.drill_env import FAULT_DRILL_ENV

CFG = tiny_qwen2_5_vl_config()
LOOP = {"max_steps": 1, "global_batch_size": 4}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer(loop, run_config=None):
    g = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    return DisaggregatedTrainer(
        model=HFModelSpec(config=CFG),
        groups={"vision": g, "text": g},
        train_loop_config=loop,
        datasets={"train": synthetic_samples(CFG, 8)},
        run_config=run_config,
    )


@pytest.fixture
def no_drill(monkeypatch):
    monkeypatch.delenv(FAULT_DRILL_ENV, raising=False)


# ---- the previous release's names --------------------------------------------------


def test_the_previous_releases_names_are_gone():
    for name in ("Qwen2_5_VLSpec", "VisionBackendConfig", "TextBackendConfig"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(ray_disagg, name)
    for module in ("ray_disagg.plan", "ray_disagg.llava", "ray_disagg.data.llava"):
        with pytest.raises(ModuleNotFoundError):
            __import__(module)


@pytest.mark.parametrize(
    "key, fix",
    [
        ("report_sample_ids", r"TrainLoopConfig\(report_sample_ids=\.\.\.\)"),
        ("report_placement", r"TrainLoopConfig\(report_placement=\.\.\.\)"),
        ("inject_failure_once", "RAY_DISAGG_FAULT_DRILL"),
    ],
)
def test_the_previous_releases_extra_options_are_refused_naming_the_fix(key, fix):
    with pytest.raises(ValueError, match=rf"extra\['{key}'\] .*removed.*{fix}"):
        TrainLoopConfig.from_any(dict(LOOP, extra={key: True}))
    assert TrainLoopConfig.from_any(dict(LOOP, extra={"mine": 1})).extra == {"mine": 1}


# ---- fault drills ---------------------------------------------------------------------


def test_drill_json_validates(tmp_path):
    value = faults.drill_json(group="text", step=2, marker=tmp_path / "m", micro_batch=1)
    assert json.loads(value) == {
        "group": "text",
        "step": 2,
        "marker": str(tmp_path / "m"),
        "rank": 0,
        "micro_batch": 1,
    }
    with pytest.raises(ValueError, match=r"unknown keys \['when'\], missing keys \['marker'\]"):
        faults.parse('{"group": "text", "step": 1, "when": 3}')
    with pytest.raises(ValueError, match="kill='everything' must be one of"):
        faults.drill_json(group="text", step=1, marker="m", kill="everything")
    with pytest.raises(ValueError, match="step=-1 must be an int >= 0"):
        faults.drill_json(group="text", step=-1, marker="m")
    assert json.loads(faults.drill_json(group="text", step=1, marker="m", trace=True))["trace"]
    with pytest.raises(ValueError, match="a trace kills nothing and traces whole steps"):
        faults.drill_json(group="text", step=1, marker="m", trace=True, kill="coordinator")
    with pytest.raises(ValueError, match="trace=1 must be a bool"):
        faults.parse('{"group": "text", "step": 1, "marker": "m", "trace": 1}')


def test_fault_drill_arms_the_environment_for_the_block_only(no_drill, tmp_path):
    with faults.fault_drill(group="vision", step=1, rank=1, marker=tmp_path / "m") as value:
        assert os.environ[FAULT_DRILL_ENV] == value
        assert json.loads(value)["rank"] == 1
    assert FAULT_DRILL_ENV not in os.environ


def test_drills_for_other_workers_or_already_done_do_nothing(monkeypatch, tmp_path):
    marker = tmp_path / "m"
    monkeypatch.setenv(FAULT_DRILL_ENV, faults.drill_json(group="text", step=2, marker=marker))
    faults.maybe_inject_failure("vision", 0, 2)  # other group
    faults.maybe_inject_failure("text", 1, 2)  # other rank
    faults.maybe_inject_failure("text", 0, 1)  # other step
    faults.maybe_inject_failure("text", 0, 2, micro_batch=0)  # a microbatch, not the step
    assert not marker.exists()
    marker.write_text("done\n")
    faults.maybe_inject_failure("text", 0, 2)  # once only: the marker says it happened
    assert marker.read_text() == "done\n"


def test_hook_imports_nothing_unarmed_and_kills_the_armed_worker_once(tmp_path):
    """A real worker process: unarmed, the hook leaves the test machinery unimported;
    armed, the matching call writes the marker and exits the process with status 1."""
    marker = tmp_path / "killed"
    script = f"""
import os, sys
from ray_disagg.worker import faults_hook
faults_hook.drill("text", 0, 2)
assert "ray_disagg.testing.faults" not in sys.modules, "imported while unarmed"
os.environ[faults_hook.FAULT_DRILL_ENV] = {faults.drill_json(group="text", step=2, marker=marker)!r}
faults_hook.drill("text", 0, 1)
faults_hook.drill("text", 0, 2)
sys.exit(7)  # not reached
"""
    env = {k: v for k, v in os.environ.items() if k != FAULT_DRILL_ENV}
    env["PYTHONPATH"] = REPO
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert marker.read_text() == "text rank 0 killed at step 2\n"


# ---- the driver hands the drill to its workers ----------------------------------------


def test_driver_copies_its_drill_into_the_workers_env(no_drill, tmp_path):
    user_env = {"env_vars": {"MINE": "1"}, "pip": ["x"]}
    trainer = _trainer(
        LOOP, RunConfig(name="r", storage_path=str(tmp_path), worker_runtime_env=user_env)
    )
    assert trainer.worker_env_vars() == {}
    with faults.fault_drill(group="text", step=1, marker=tmp_path / "m") as value:
        env = trainer.worker_env_vars()
    assert env == {FAULT_DRILL_ENV: value}
    base = trainer.train_run_context
    ctx = rc.with_worker_env_vars(base, env)
    assert ctx.run_id == base.run_id
    assert ctx.run_config.worker_runtime_env == {
        "env_vars": {FAULT_DRILL_ENV: value, "MINE": "1"},
        "pip": ["x"],
    }
    assert base.run_config.worker_runtime_env == user_env  # the user's RunConfig untouched
    assert rc.with_worker_env_vars(base, {}) is base
