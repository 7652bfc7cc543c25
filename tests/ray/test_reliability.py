"""Tier 3: faults and bad input on a real Ray cluster: non-finite steps are never applied,
batches without labels are skipped, every step is in the run's history, a dead
coordinator leaks no placement group, infeasible resources fail on the driver, and the
cluster stays on loopback."""

import math
import os

import numpy as np
import pytest
import ray
import torch
from ray.train import Checkpoint

from ray_disagg import HFModelSpec, load_metrics, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.faults import fault_drill
from tests.helpers import checkpoint_state, every_cpu_free, group, run_layout, vt

LOOP = {"max_steps": 3, "global_batch_size": 4, "shuffle": False, "eps": 1e-6}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    data = synthetic_samples(cfg, 12, grids=[(1, 4, 4), (1, 8, 4), None])
    data[4] = dict(data[4], id="nan-pixel", pixel_values=data[4]["pixel_values"].copy())
    data[4]["pixel_values"][0, 0] = np.nan  # step 2
    for i in range(8, 12):  # step 3: no label token at all
        data[i] = dict(data[i], labels=np.full_like(data[i]["labels"], -100))
    return HFModelSpec(config=cfg, seed=1), data


def test_cluster_and_side_group_stay_on_loopback(ray_start_4_cpus):
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    # the side group's TCPStore and gloo devices use this address (runtime.host_side_store)
    addr = ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote())
    assert addr == "127.0.0.1"


def test_nan_step_raises_naming_the_samples(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    with pytest.raises(ray.train.TrainingFailedError, match=r"step 2: loss nan.*'nan-pixel'"):
        run_layout(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "nan")


def test_local_runner_names_the_failed_worker(setup, tmp_path):
    """The same failure without Ray (``testing.local``): an error naming group and rank."""
    spec, data = setup
    with pytest.raises(RuntimeError, match=r"(?s)\[text group rank 0 failed\].*step 2: loss nan"):
        run_layout(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "nan", local=True)


def test_skipped_steps_history_and_finite_checkpoints(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    loop = dict(LOOP, skip_nonfinite_steps=True, checkpoint_every=1)
    result = run_layout(spec, data, loop, vt(group(2), group(1)), tmp_path, "skip")
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


def test_dead_coordinator_leaks_no_placement_group(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    data = data[:4] * 3  # finite data
    drill = fault_drill(group="text", step=1, marker=tmp_path / "m", kill="coordinator")
    with drill, pytest.raises(Exception):  # noqa: B017 - whatever the driver sees of the dead actor
        run_layout(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "dead")
    assert os.path.exists(tmp_path / "m")
    states = [pg["state"] for pg in ray.util.placement_group_table().values()]
    assert "CREATED" not in states and "PENDING" not in states, states
    # every CPU of the cluster is free again (a fit that needs them all could start)
    assert every_cpu_free(60.0) == 4


def test_infeasible_resources_fail_on_the_driver(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    with pytest.raises(ValueError, match=r"CPU: the groups need 9 together, the cluster has 4"):
        loop = dict(LOOP, global_batch_size=8)
        run_layout(spec, data, loop, vt(group(8, cpus=1.0), group(1, cpus=1.0)), tmp_path, "big")
