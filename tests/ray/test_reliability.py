"""Tier 3: faults and bad input on a real Ray cluster: a non-finite step fails the run
naming the samples (skipping such steps, without Ray: ``tests/gloo/test_nonfinite.py``),
a dead coordinator leaks no placement group, infeasible resources fail on the driver, and
the cluster stays on loopback."""

import os

import pytest
import ray

from ray_disagg.testing.faults import fault_drill
from tests.helpers import NONFINITE_LOOP as LOOP
from tests.helpers import every_cpu_free, group, nonfinite_setup, run_layout, vt


@pytest.fixture(scope="module")
def setup():
    return nonfinite_setup()


def test_cluster_and_side_group_stay_on_loopback(ray_start_4_cpus):
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    # the side group's TCPStore and gloo devices use this address (runtime.host_side_store)
    addr = ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote())
    assert addr == "127.0.0.1"


def test_nan_step_raises_naming_the_samples(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    with pytest.raises(ray.train.TrainingFailedError, match=r"step 2: loss nan.*'nan-pixel'"):
        run_layout(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "nan")


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
