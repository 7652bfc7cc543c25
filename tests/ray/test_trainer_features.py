"""Tier 3: what users expect of a trainer, on a real Ray cluster, against the single-process
model: learning-rate schedules with per-group multipliers, freezing by name prefix,
validation with checkpoint scoring, sequence packing under a token budget,
and Ray Train user callbacks. One fit exercises several features and is checked several
ways. (A whole frozen group is tested through the CLI: tests/ray/test_cli.py; a frozen LLM
in the gloo tier: tests/gloo/test_frozen_llm.py.)"""

import json
import os
import re
import time
import urllib.request

import pytest
import torch
from ray.train import Checkpoint, CheckpointConfig, UserCallback

from ray_disagg import (
    HFModelSpec,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.config.lr_schedule import lr_at
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.reference import reference_train
from tests.helpers import (
    assert_params_close,
    built_trainer,
    checkpoint_state,
    group,
    run_layout,
    vt,
)

# lengths differ a lot (text-only up to 12x8 patches), so packing puts several in a row
GRIDS = [(1, 4, 4), (1, 12, 8), None, (1, 4, 8), None, (1, 8, 8), (1, 4, 4), None]
LOOP = {
    "max_steps": 4,
    "global_batch_size": 8,
    "micro_batches": 2,
    "checkpoint_every": 1,
    "lr": 2e-3,
    "eps": 1e-6,
    "seed": 7,
    "lr_schedule": "cosine",
    "warmup_steps": 1,
    "min_lr_ratio": 0.2,
    "eval_every": 1,
    "pack_sequences": True,
    "max_seq_len": 48,
    "max_tokens_per_microbatch": 48,  # some steps take fewer than 8 samples
    "peak_tflops": 1.0,  # MFU on a CPU (Ray metrics show it)
}
FROZEN = ("model.visual.patch_embed", "model.visual.blocks")  # the tower, not the merger


class RecordReports(UserCallback):
    """Appends every report the controller sees to a file (callbacks run in the
    controller actor, not in the test process)."""

    def __init__(self, path: str):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": metrics[0]["step"], "ckpt": checkpoint is not None}))
            f.write("\n")


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=11)
    return spec, synthetic_samples(cfg, 16, grids=GRIDS), synthetic_samples(cfg, 8, seed=1)


def test_schedule_freezing_validation_packing_and_callbacks_match_reference(
    ray_start_4_cpus, setup, tmp_path, monkeypatch
):
    """(Also the experiment trackers, logging from the driver: TensorBoard, MLflow and
    W&B offline.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec, data, val = setup
    groups = vt(group(1), group(2, TensorParallel(size=2)))
    groups["vision"].freeze, groups["vision"].lr_multiplier = FROZEN, 3.0
    reports = tmp_path / "reports.jsonl"
    score = CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"
    )
    result = run_layout(
        spec,
        data,
        LOOP,
        groups,
        tmp_path,
        "features",
        validation=val,
        callbacks=[RecordReports(str(reports))],
        checkpoint_config=score,
        report_to=["tensorboard", "mlflow", "wandb"],
    )
    cfg = TrainLoopConfig(**LOOP)
    planned = built_trainer(spec, data, LOOP, groups, tmp_path, validation=val)
    plan, val_plan = planned.plan, planned.val_plan
    ref = reference_train(spec, data, cfg, groups=groups, val=val, plan=plan, val_plan=val_plan)
    ref_losses, _, ref_model, ref_val = ref
    history = load_metrics(result)  # every step (metrics_dataframe: the kept checkpoints)
    counts = [len(plan.global_indices(s)) for s in range(4)]
    assert history["samples"].tolist() == counts and min(counts) < 8
    rtol = {"rtol": 1e-5, "atol": 0.0}
    torch.testing.assert_close(
        torch.tensor(history["loss"].tolist()), torch.tensor(ref_losses), **rtol
    )
    torch.testing.assert_close(
        torch.tensor(history["val_loss"].tolist()), torch.tensor(ref_val), **rtol
    )
    # the schedule, and the vision group's multiplier
    assert history["lr"].tolist() == [lr_at(cfg, s) for s in range(4)]
    assert history["vision_lr"].tolist() == [lr_at(cfg, s, 3.0) for s in range(4)]
    # parameters: the frozen tower is bit-identical to the initial weights, the rest equals
    # the single-process run with the same freezing
    last = os.path.join(result.path, "checkpoint_000004")
    state = checkpoint_state(Checkpoint(last))
    initial = spec.build_full().state_dict()
    frozen = [k for k in state if k.startswith(FROZEN)]
    assert frozen and all(torch.equal(state[k], initial[k]) for k in frozen)
    assert not torch.equal(
        state["model.visual.merger.mlp.0.weight"], initial["model.visual.merger.mlp.0.weight"]
    )
    assert_params_close(state, ref_model.state_dict())
    # checkpoint scoring by val_loss kept the two best checkpoints (and the latest)
    kept = {d for d in os.listdir(result.path) if re.fullmatch(r"checkpoint_\d{6}", d)}
    best = history.nsmallest(2, "val_loss")["step"].tolist()
    assert (
        {f"checkpoint_{s:06d}" for s in best} <= kept <= {f"checkpoint_{s:06d}" for s in [*best, 4]}
    )
    # every step reached the trackers, from the driver, with the run's settings
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(result.path, "tensorboard"))
    events.Reload()
    logged = events.Scalars("val_loss")
    assert [e.step for e in logged] == [1, 2, 3, 4]
    assert [e.value for e in logged] == pytest.approx(history["val_loss"].tolist(), rel=1e-6)
    client = MlflowClient(tracking_uri=f"sqlite:///{result.path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ray_disagg").experiment_id])
    assert run.data.params["loop.max_tokens_per_microbatch"] == "48"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 4
    assert os.listdir(os.path.join(result.path, "wandb"))
    # and to Ray's metrics (gauges on the driver), as the node's exporter shows them
    gauges = _ray_gauges("features", ("ray_disagg_loss", "ray_disagg_group_mfu"), last_step=4)
    assert gauges["ray_disagg_loss"][""] == pytest.approx(history["loss"].iloc[-1], rel=1e-6)
    assert set(gauges["ray_disagg_group_mfu"]) == {'group="vision"', 'group="text"'}
    # the user callback saw every report, once, each with its checkpoint
    seen = [json.loads(line) for line in reports.read_text().splitlines()]
    assert seen == [{"step": s, "ckpt": True} for s in range(1, 5)]


def _ray_gauges(run: str, names, last_step: int, timeout_s: float = 60.0) -> dict:
    """``{name: {group tag or "": value}}`` of ``run``'s gauges from the node's metrics
    export port, polled until every name shows and ``ray_disagg_step`` is ``last_step``
    (Ray exports every 10 s: an export may still hold an earlier step's values)."""
    import ray

    names = {*names, "ray_disagg_step"}
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline, found = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        found = {}
        for name, tags, value in re.findall(r"^(\w+)\{(.*)\} (\S+)$", text, re.M):
            if name in names and f'run="{run}"' in tags:
                group = re.search(r'group="[^"]*"', tags)
                found.setdefault(name, {})[group.group(0) if group else ""] = float(value)
        if set(found) == names and found["ray_disagg_step"].get("") == last_step:
            return found
        time.sleep(1.0)
    raise AssertionError(f"Ray's metrics export showed {found} of {names} at {last_step=}")
