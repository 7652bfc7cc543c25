"""Tier 1 (unit, no Ray cluster): the coordinator's policies and their execution, driven
through a fake of the worker groups' facade (the methods ``ModuleWorkerGroups`` offers
it) and a fake cluster view, as Ray Train's own controller tests drive its controller
with a dummy worker group. Restart only the failed group, fall back to the full
restart, a standby's take-over, grow and shrink an elastic group; Ray's failure count
is kept by the run's failure policy, never edited."""

from types import SimpleNamespace

import pytest
from ray.train import Checkpoint, FailureConfig, ScalingConfig

from ray_disagg.launch.coordinator import Coordinator
from ray_disagg.launch.launches import GroupLaunch, Launch, Transfers
from ray_disagg.launch.ray_compat import FailureDecision, WorkerStatus
from ray_disagg.launch.recovery.elastic import ElasticGroup, ElasticPolicy
from ray_disagg.launch.recovery.policies import GroupFailurePolicy, GroupRestartPolicy
from ray_disagg.launch.recovery.restart import GroupRecovery
from ray_disagg.launch.recovery.survivors import Relaunch
from ray_disagg.launch.worker_groups import ModulePollStatus

RETRY, RAISE = FailureDecision.RETRY, FailureDecision.RAISE


def _launch(vision: int, text: int = 1) -> Launch:
    def group(name, n):
        return GroupLaunch(name, ScalingConfig(num_workers=n), None, None)

    return Launch({"text": group("text", text), "vision": group("vision", vision)}, Transfers(()))


def _latest(step: int):
    return SimpleNamespace(checkpoint=Checkpoint(f"/ckpt/{step}"), metrics={"step": step})


class FakeWorkerGroup:
    def __init__(self, n: int):
        self.n = n


class FakeGroups:
    """The facade ``ModuleWorkerGroups`` offers the coordinator, recording each step."""

    def __init__(self, launch: Launch, fail_at: str | None = None):
        self.sizes = {n: g.scaling_config.num_workers for n, g in launch.groups.items()}
        self.steps, self.fail_at = [], fail_at
        self.recovery = GroupRecovery(Relaunch(launch.groups, None, "a1", [], 5.0, None))

    def status(self, failed: str | None = None) -> ModulePollStatus:
        statuses = {}
        for name, n in self.sizes.items():
            for _ in range(n):
                err = RuntimeError(f"{name} died") if name == failed and failed else None
                statuses[len(statuses)] = WorkerStatus(running=err is None, error=err)
                failed = None if err else failed  # one rank fails
        return ModulePollStatus(worker_statuses=statuses)

    def failed_groups(self, status) -> set[str]:
        owners = [name for name, n in self.sizes.items() for _ in range(n)]
        return {owners[i] for i in status.errors}

    def _step(self, *step):
        self.steps.append(step)
        if step[0] == self.fail_at:
            raise RuntimeError(f"{step[0]} failed")

    def stop_group(self, name):
        self._step("stop", name)

    def interrupt_survivors(self, failed, generation, checkpoint, timeout_s):
        self._step("interrupt", failed, generation, checkpoint.path)

    def park_survivors(self, failed, timeout_s):
        self._step("park", failed)

    def start_group(self, launch, relaunch):
        self._step("start", launch.name, launch.scaling_config.num_workers)
        return FakeWorkerGroup(launch.scaling_config.num_workers)

    def install_group(self, name, wg):
        self._step("install", name, wg.n)
        self.sizes[name] = wg.n

    def connect_channel(self, run_attempt_id, timeout_s, transfers):
        self._step("rejoin", self.recovery.generation)

    def poll_status(self, timeout=None):
        return self.status()


class FakeStandby:
    def __init__(self):
        self.took, self.starts = [], 0

    def take_over(self, checkpoint, timeout_s):
        self.took.append(checkpoint.path)
        return FakeWorkerGroup(1)

    def start(self, relaunch):
        self.starts += 1

    def close(self, wait_s=0.0):
        pass


class FakeCluster:
    """Free CPUs on one node, as Ray would show them."""

    def __init__(self, cpus: float):
        self.cpus = cpus

    def free_total(self):
        return {"CPU": self.cpus}

    def free_per_node(self):
        return [{"CPU": self.cpus}]

    def probe(self, per_worker, count, strategy, timeout_s):
        return count * per_worker["CPU"] <= self.cpus


def _coordinator(launch, max_failures=2, elastic=None, restartable=("vision",)):
    failures = GroupFailurePolicy(FailureConfig(max_failures=max_failures))
    restart = GroupRestartPolicy(frozenset(restartable), failures, elastic)
    coord = Coordinator(launch=launch, restart=restart)
    return coord, failures


def _counted(failures: GroupFailurePolicy, error) -> int:
    """How many failures Ray's policy has counted, read by asking it until it raises."""
    n = 0
    while failures.make_decision(error) == RETRY:
        n += 1
    return failures.failure_config.max_failures - n


RESTART = [
    ("stop", "vision"),
    ("interrupt", "vision", 1, "/ckpt/2"),
    ("park", "vision"),
    ("start", "vision", 1),
    ("install", "vision", 1),
    ("rejoin", 1),
]


def test_a_failed_encoder_group_restarts_alone_and_counts_once():
    launch = _launch(1)
    coord, failures = _coordinator(launch)
    groups = FakeGroups(launch)
    failed = groups.status("vision")
    after = coord.after_poll(groups, failed, _latest(2), 0.1)
    assert groups.steps == RESTART
    assert not after.errors and groups.recovery.restarts == {"text": 0, "vision": 1}
    assert _counted(failures, failed.get_worker_group_error()) == 1


@pytest.mark.parametrize(
    "failed, latest, fail_at, max_failures, steps",
    [
        ("text", _latest(2), None, 2, []),  # the LLM group: every group restarts
        ("vision", None, None, 2, []),  # before any checkpoint
        ("vision", _latest(2), "park", 2, RESTART[:3]),  # the restart itself failed
        ("vision", _latest(2), None, 0, []),  # no retries left: Ray raises it
    ],
    ids=["llm-failure", "no-checkpoint", "restart-failed", "no-retries"],
)
def test_everything_else_falls_back_to_the_full_restart(
    failed, latest, fail_at, max_failures, steps
):
    """Each failure is counted once: by the coordinator when it decided, else by Ray."""
    launch = _launch(1)
    coord, failures = _coordinator(launch, max_failures=max_failures)
    groups = FakeGroups(launch, fail_at=fail_at)
    status = groups.status(failed)
    assert coord.after_poll(groups, status, latest, 0.1) is status  # Ray Train's to decide
    assert groups.steps == steps
    error = status.get_worker_group_error()
    if max_failures == 0:
        assert failures.make_decision(error) == RAISE  # settled: not counted a second time
    else:  # Ray's decision on this very error, then the retries left
        assert failures.make_decision(error) == RETRY
        assert _counted(failures, error) == 1


def test_the_standby_takes_the_failed_groups_place_and_is_replenished():
    launch = _launch(1)
    coord, _ = _coordinator(launch)
    groups = FakeGroups(launch)
    standby = groups.recovery.standby["vision"] = FakeStandby()
    groups.recovery.takeovers["vision"] = 0
    coord.after_poll(groups, groups.status("vision"), _latest(2), 0.1)
    assert [s[0] for s in groups.steps] == ["stop", "interrupt", "park", "install", "rejoin"]
    assert standby.took == ["/ckpt/2"] and groups.recovery.takeovers["vision"] == 1
    coord.after_poll(groups, groups.status(), _latest(2), 0.1)
    assert standby.starts == 0  # not while the recovery's checkpoint is the latest
    coord.after_poll(groups, groups.status(), _latest(4), 0.1)
    assert standby.starts == 1 and groups.recovery.standby_after == {}


def _elastic(cluster: FakeCluster):
    group = ElasticGroup(
        name="vision",
        launches={1: _launch(1), 2: _launch(2)},
        per_worker={"CPU": 1},
        interval_s=0.0,
        max_steps=10,
    )
    return ElasticPolicy(group, cluster)


def test_an_elastic_group_grows_at_the_next_checkpoint_when_room_appears():
    cluster = FakeCluster(cpus=2)  # one CPU for text, one for vision
    elastic = _elastic(cluster)
    coord, failures = _coordinator(_launch(1), elastic=elastic)
    groups = coord.start(FakeGroups)
    assert elastic.group.size == 1 and groups.sizes == {"text": 1, "vision": 1}
    cluster.cpus = 1  # a CPU appears beside the running groups
    coord.after_poll(groups, groups.status(), _latest(2), 0.1)
    assert elastic.group.grow_to == 2 and groups.steps == []  # waits for a checkpoint
    after = coord.after_poll(groups, groups.status(), _latest(4), 0.1)
    assert [s for s in groups.steps if s[0] == "start"] == [("start", "vision", 2)]
    assert not after.errors and groups.sizes["vision"] == 2 and elastic.group.size == 2
    assert coord.launch.groups["vision"].scaling_config.num_workers == 2  # for full restarts
    assert groups.recovery.restarts["vision"] == 0  # a resize is not a failure
    assert _counted(failures, groups.status("vision").get_worker_group_error()) == 0


def test_a_failed_grow_restarts_every_group_without_counting_a_failure():
    cluster = FakeCluster(cpus=2)
    elastic = _elastic(cluster)
    coord, failures = _coordinator(_launch(1), elastic=elastic)
    groups = coord.start(lambda launch: FakeGroups(launch, fail_at="park"))
    cluster.cpus = 1
    coord.after_poll(groups, groups.status(), _latest(2), 0.1)
    after = coord.after_poll(groups, groups.status(), _latest(4), 0.1)
    assert "growing the vision group from 1 workers failed" in str(after.errors[0])
    error = after.get_worker_group_error()
    assert failures.make_decision(error) == RETRY and _counted(failures, error) == 0


def test_an_elastic_group_shrinks_when_a_lost_workers_resources_are_gone():
    cluster = FakeCluster(cpus=3)
    elastic = _elastic(cluster)
    coord, _ = _coordinator(_launch(1), elastic=elastic)
    groups = coord.start(FakeGroups)
    assert elastic.group.size == 2
    cluster.cpus = 1  # the node of a vision worker is gone: one worker's room left
    after = coord.after_poll(groups, groups.status("vision"), _latest(2), 0.1)
    assert ("start", "vision", 1) in groups.steps and elastic.group.size == 1
    assert not after.errors and groups.recovery.restarts["vision"] == 1
    assert coord.launch.groups["vision"].scaling_config.num_workers == 1
