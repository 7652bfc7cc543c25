"""Tier 1: experiment trackers with the real packages. Each step the progress display
takes from the coordinator's feed reaches TensorBoard's event files (read back with
TensorBoard's event reader), an MLflow sqlite store (through ``MlflowClient``) and an
offline W&B run (its run files hold the metrics and parameters), with the run's
settings as parameters; a second ``fit()`` in the same run directory continues the same
tracker runs (a redone step is logged once); a tracker that fails warns and the others
go on; bad ``report_to`` values are refused naming the fix."""

import glob
import json
import logging
import os
from pathlib import Path

import pytest

from ray_disagg.launch import trackers
from ray_disagg.launch.progress import Progress
from ray_disagg.launch.trackers import Trackers, check_report_to

ALL = ("tensorboard", "mlflow", "wandb")


def _reports(steps) -> list[dict]:
    return [
        {"step": s, "loss": 5.0 - 0.5 * s, "lr": 1e-3, "step_time_s": 0.1,
         "tokens_per_s": 900.0, "sample_ids": [1], "loss/docs": float("nan")}
        for s in steps
    ]  # fmt: skip


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)


def test_steps_reach_every_tracker_and_a_second_fit_continues_their_runs(tmp_path, offline):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    params = {"loop.lr": "0.001", "group.text.workers": "2"}
    for steps in ([1, 2, 3], [3, 4, 5]):  # the second: a resumed fit redoing step 3
        sinks = Trackers(ALL, run_dir, "run", params)
        feed = _reports(steps)
        progress = Progress(lambda n, f=feed: f[n:], 5, echo=lambda _: None, on_step=sinks.log)
        progress.poll()
        sinks.finish()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [(s, 5.0 - 0.5 * s) for s in range(1, 6)]
    assert "loss/docs" not in events.Tags()["scalars"]  # NaN: not logged

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    exp = client.get_experiment_by_name("ray_disagg")
    (run,) = client.search_runs([exp.experiment_id])  # one run across both fits
    assert run.data.params == params and run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == losses

    with open(os.path.join(run_dir, "trackers.json")) as f:
        ids = json.load(f)
    files = glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{ids['wandb']}", "*.wandb"))
    # one id for both fits (their offline directories share a name within a second)
    assert files and all(os.path.getsize(f) > 0 for f in files)
    data = b"".join(Path(f).read_bytes() for f in files)  # protobuf records: keys as bytes
    assert b"loss" in data and b"loop.lr" in data  # (wandb 0.30 has no `sync --view`)


def test_a_failing_tracker_warns_and_the_others_go_on(tmp_path, offline, caplog):
    run_dir = str(tmp_path)
    sinks = Trackers(("mlflow", "tensorboard"), run_dir, "run", {})
    sinks.log({"step": 1, "loss": 1.0})
    sinks.open["mlflow"].client.delete_run(sinks.open["mlflow"].run_id)  # someone deleted it
    with caplog.at_level(logging.WARNING, logger="ray_disagg.trainer"):
        sinks.log({"step": 2, "loss": 0.5})
        sinks.log({"step": 3, "loss": 0.25})
    assert "report_to mlflow failed at step 2" in caplog.text and list(sinks.open) == [
        "tensorboard"
    ]
    deleted = sinks.ids["mlflow"]
    sinks.finish()
    sinks.log({"step": 4, "loss": 0.1})  # after closing (a late poll): nothing happens
    again = Trackers(("mlflow",), run_dir, "run", {})  # its stored run was deleted
    assert again.ids["mlflow"] != deleted and again.ids["last_step"] == 3
    again.finish()
    with open(os.path.join(run_dir, "trackers.json"), "w") as f:
        f.write('{"mlflow": "' + deleted + '", "last_')  # cut short by a crash
    fresh = Trackers(("tensorboard",), run_dir, "run", {})
    assert "last_step" not in fresh.ids  # read as a fresh start
    fresh.finish()


@pytest.mark.parametrize(
    "value,match",
    [
        (["tensorboard", "comet"], r"unknown tracker 'comet'; choose from"),
        (["wandb", "wandb"], r"'wandb' is given twice"),
    ],
)
def test_bad_report_to_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        check_report_to(value)


def test_wandb_online_without_credentials_and_a_missing_package_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ValueError, match=r"WANDB_API_KEY.*WANDB_MODE=offline"):
        check_report_to("wandb")
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", "mlflow_not_installed_here")
    with pytest.raises(ValueError, match=r"pip install 'ray_disagg\[mlflow\]'"):
        check_report_to(["mlflow"])
    assert check_report_to(None) == () and check_report_to("tensorboard") == ("tensorboard",)


def test_a_recipe_names_its_trackers_and_a_remote_run_is_refused(tmp_path):
    from ray.train import RunConfig, ScalingConfig

    from ray_disagg import DisaggregatedTrainer, HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.recipes.recipe import load_recipe

    def recipe(report_to):
        return load_recipe({
            "model": {"config": "tiny_qwen2_5_vl"},
            "data": {"train": {"type": "digits", "num_samples": 8}},
            "groups": {"vision": {"num_workers": 1}, "text": {"num_workers": 1}},
            "train_loop_config": {"max_steps": 2, "global_batch_size": 4},
            "run_config": {"report_to": report_to},
        })  # fmt: skip

    assert recipe(["tensorboard", "mlflow"]).report_to == ("tensorboard", "mlflow")
    with pytest.raises(ValueError, match=r"run_config.report_to\[1\]='neptune'"):
        recipe(["tensorboard", "neptune"])
    cfg, g = tiny_qwen2_5_vl_config(), ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    remote = DisaggregatedTrainer(  # trackers on remote storage: files stay on the driver
        model=HFModelSpec(config=cfg),
        groups={"vision": g, "text": g},
        train_loop_config={"max_steps": 1, "global_batch_size": 4},
        datasets={"train": synthetic_samples(cfg, 4)},
        run_config=RunConfig(name="r", storage_path="s3://bucket/runs"),
        report_to="tensorboard",
    )
    assert remote.report_to == ("tensorboard",)
    assert remote.tracker_dir() == os.path.expanduser("~/ray_results/r")
