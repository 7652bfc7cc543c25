"""Tier 3: faults and bad input on a real Ray cluster: a dead coordinator or Ctrl-C leaves
nothing behind, and the next fit's non-finite step fails the run naming the samples
(skipping such steps, without Ray: ``tests/gloo/test_nonfinite.py``); infeasible
resources fail on the driver, and the cluster stays on loopback."""

import contextlib
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


def test_a_dead_coordinator_or_an_interrupt_leaves_nothing_behind(
    ray_start_4_cpus, setup, tmp_path
):
    """Each fit asks for every CPU of the cluster (1 + 1 workers of 2 CPUs), so anything
    left behind would keep the next one waiting forever: the coordinator SIGKILLed while
    it starts the groups (a group's placement group reserved, the other's maybe not yet),
    then Ctrl-C mid-run; after each, the run's placement groups and actors are gone within
    a bounded time, and the next fit runs: until its non-finite step, which fails the run
    naming the samples."""
    spec, nan_data = setup
    data = nan_data[:4] * 30  # finite data, more steps than the interrupted run reaches
    groups, loop = vt(group(1, cpus=2.0), group(1, cpus=2.0)), dict(LOOP, max_steps=30)
    before = _Snapshot()
    kill = _when(lambda: before.new_pgs("CREATED"), lambda: _sigkill(before.new_coordinator()))
    with kill, pytest.raises(ray.exceptions.ActorDiedError):
        run_layout(spec, data, loop, groups, tmp_path, "dead")
    before.assert_nothing_left()

    handler = signal.getsignal(signal.SIGINT)
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    interrupt = _when(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, _ctrl_c)
    with interrupt, pytest.raises(KeyboardInterrupt):
        run_layout(spec, data, loop, groups, tmp_path, "interrupted")
    assert 1 <= metrics.read_text().count("\n") < 30  # interrupted mid-run
    assert signal.getsignal(signal.SIGINT) is handler  # the driver's handler is back
    before.assert_nothing_left()

    with pytest.raises(ray.train.TrainingFailedError, match=r"step 2: loss nan.*'nan-pixel'"):
        run_layout(spec, nan_data, LOOP, groups, tmp_path, "nan")


class _Snapshot:
    """The cluster's placement groups and actors before a run, to tell the run's own."""

    def __init__(self):
        self.pgs = set(ray.util.placement_group_table())
        self.actors = {a["actor_id"] for a in live_actors()}

    def new_pgs(self, *states: str) -> list[str]:
        return [
            pg["name"]
            for pg_id, pg in ray.util.placement_group_table().items()
            if pg_id not in self.pgs and run_of(pg["name"]) and pg["state"] in states
        ]

    def new_actors(self) -> list[dict]:
        return [a for a in live_actors() if a["actor_id"] not in self.actors]

    def new_coordinator(self) -> int:
        (pid,) = [
            a["pid"] for a in self.new_actors() if a["class_name"] == "DisaggregatedController"
        ]
        return pid

    def assert_nothing_left(self, timeout_s: float = 30.0) -> None:
        """No placement group of a later run reserved and no coordinator or worker of one
        alive, within ``timeout_s``; then every CPU free."""
        deadline = time.monotonic() + timeout_s
        while True:
            pgs = self.new_pgs("PENDING", "PREPARED", "CREATED", "RESCHEDULING")
            ours = ("DisaggregatedController", "RayTrainWorker")
            actors = [a["class_name"] for a in self.new_actors() if a["class_name"] in ours]
            if not pgs and not actors:
                break
            assert time.monotonic() < deadline, f"left behind: {pgs} {actors}"
            time.sleep(0.2)
        assert every_cpu_free(timeout_s) == 4


@contextlib.contextmanager
def _when(condition, then, timeout_s: float = 120.0):
    """Inside the block: ``then()`` once ``condition()`` holds (looked at every 50 ms, up
    to ``timeout_s``), in a thread joined at the end; fails when it never did."""
    stop, fired = threading.Event(), threading.Event()

    def watch():
        deadline = time.monotonic() + timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            if condition():
                then()
                fired.set()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    assert fired.is_set(), "the condition never held during the run"


def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_infeasible_resources_fail_on_the_driver(ray_start_4_cpus, setup, tmp_path):
    spec, data = setup
    with pytest.raises(ValueError, match=r"CPU: the groups need 9 together, the cluster has 4"):
        loop = dict(LOOP, global_batch_size=8)
        run_layout(spec, data, loop, vt(group(8, cpus=1.0), group(1, cpus=1.0)), tmp_path, "big")
