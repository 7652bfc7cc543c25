"""Tier 3: faults and bad input on a real Ray cluster: a non-finite step fails the run
naming the samples (skipping such steps, without Ray: ``tests/gloo/test_nonfinite.py``),
a dead coordinator or Ctrl-C leaves nothing behind, infeasible resources fail on the
driver, and the cluster stays on loopback."""

import os
import signal
import threading
import time

import pytest
import ray

from ray_disagg.launch.ray_compat import live_actors
from ray_disagg.launch.reservations import run_of
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


def test_a_dead_coordinator_or_an_interrupt_leaves_nothing_behind(
    ray_start_4_cpus, setup, tmp_path
):
    """Each fit asks for every CPU of the cluster (2 + 2 workers of 1 CPU), so anything
    left behind would keep the next one waiting forever: the coordinator SIGKILLed while
    it starts the groups (a group's placement group reserved, the other's maybe not yet),
    then Ctrl-C mid-run; after each, the run's placement groups and actors are gone within
    a bounded time, and the last fit completes."""
    spec, data = setup
    data = data[:4] * 30  # finite data, more steps than the interrupted run reaches
    groups = vt(group(2, cpus=1.0), group(2, cpus=1.0))
    killer = _when(_reserving, _sigkill_coordinator)
    with pytest.raises(ray.exceptions.ActorDiedError):
        run_layout(spec, data, dict(LOOP, max_steps=30), groups, tmp_path, "dead")
    assert killer.done.is_set()
    _assert_nothing_left()

    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    _when(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, _ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_layout(spec, data, dict(LOOP, max_steps=30), groups, tmp_path, "interrupted")
    assert 1 <= metrics.read_text().count("\n") < 30  # interrupted mid-run
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    _assert_nothing_left()

    result = run_layout(spec, data, LOOP, groups, tmp_path, "after")
    assert result.error is None and result.metrics["step"] == LOOP["max_steps"]


class _when(threading.Thread):
    """Run ``then`` once ``condition`` holds (checked every 50 ms, for up to 120 s)."""

    def __init__(self, condition, then):
        super().__init__(daemon=True)
        self.condition, self.then, self.done = condition, then, threading.Event()
        self.start()

    def run(self):
        deadline = time.monotonic() + 120
        while not self.condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.then()
        self.done.set()


def _reserving() -> bool:
    """A placement group of a run is reserved (the coordinator is starting the groups)."""
    pgs = ray.util.placement_group_table().values()
    return any(run_of(pg["name"]) and pg["state"] == "CREATED" for pg in pgs)


def _sigkill_coordinator() -> None:
    (pid,) = [a["pid"] for a in live_actors() if a["class_name"] == "DisaggregatedController"]
    os.kill(pid, signal.SIGKILL)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _assert_nothing_left(timeout_s: float = 30.0) -> None:
    """No placement group of a run reserved and no coordinator or worker alive, within
    ``timeout_s``; then every CPU free."""
    deadline = time.monotonic() + timeout_s
    while True:
        pgs = [
            pg["name"]
            for pg in ray.util.placement_group_table().values()
            if run_of(pg["name"]) and pg["state"] != "REMOVED"
        ]
        actors = [
            a["class_name"]
            for a in live_actors()
            if a["class_name"] in ("DisaggregatedController", "RayTrainWorker")
        ]
        if not pgs and not actors:
            break
        assert time.monotonic() < deadline, f"left behind: {pgs} {actors}"
        time.sleep(0.2)
    assert every_cpu_free(timeout_s) == 4


def test_infeasible_resources_fail_on_the_driver(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    with pytest.raises(ValueError, match=r"CPU: the groups need 9 together, the cluster has 4"):
        loop = dict(LOOP, global_batch_size=8)
        run_layout(spec, data, loop, vt(group(8, cpus=1.0), group(1, cpus=1.0)), tmp_path, "big")
