"""Elastic encoder groups, a standby group and a failure during a group restart (tier 3,
a real Ray cluster; placeholder actors take and free the cluster's CPUs)."""

import dataclasses
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from ray.train import ScalingConfig

from ray_disagg import ModuleGroup
from ray_disagg.testing.faults import fault_drill
from tests.helpers import (
    RESTART_LOOP,
    assert_bit_identical,
    assert_params_close,
    checkpoint_state,
    every_cpu_free,
    group,
    losses,
    restart_setup,
    vt,
)
from tests.helpers import run_layout as fit

LOOP = RESTART_LOOP


@pytest.fixture(scope="module")
def setup():
    return restart_setup()


@ray.remote(num_cpus=0)
class _Placeholder:
    """Holds CPUs the elastic group could use (``options(num_cpus=...)``)."""

    def ready(self) -> bool:
        return True


def _history(path, timeout_s: float, until) -> list[dict]:
    """The run's reported steps (``metrics.jsonl``) once ``until(lines)`` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if until(lines):
            return lines
        time.sleep(0.05)
    raise TimeoutError(f"{path}: condition not reached in {timeout_s}s")


def test_elastic_vision_group_grows_and_shrinks_without_restarting_the_llm(
    ray_start_4_cpus, setup, tmp_path
):
    """Vision ``num_workers=(1, 2)``: it starts with 1 (a placeholder holds the other
    CPUs), grows to 2 when the placeholder goes, and shrinks back to 1 when a worker dies
    and another placeholder takes its CPUs; the text group keeps its worker throughout.
    Losses and parameters equal a fixed-size run's within 1e-5."""
    _, spec, data = setup
    loop = dict(LOOP, max_steps=12)
    elastic = ModuleGroup(
        scaling_config=ScalingConfig(
            num_workers=(1, 2),
            resources_per_worker={"CPU": 0.5},
            elastic_resize_monitor_interval_s=0.5,
        )
    )
    # an earlier test's workers may still be releasing theirs: a placeholder sized
    # meanwhile would leave room it must not leave
    free = every_cpu_free(30.0)
    first = _Placeholder.options(num_cpus=free - 1.0).remote()  # room for 1 + 1 workers
    ray.get(first.ready.remote())
    marker, history = tmp_path / "killed", tmp_path / "elastic" / "metrics.jsonl"
    second = None
    # (the kill comes a few steps after the growth: the history is the driver's, which
    # takes each step from the coordinator a moment after it was reported)
    with fault_drill(group="vision", step=9, rank=1, marker=marker), ThreadPoolExecutor(1) as ex:
        run = ex.submit(fit, spec, data, loop, vt(elastic, group(1)), tmp_path, "elastic",
                        failures=1)  # fmt: skip
        _history(history, 300, lambda lines: len(lines) >= 1)
        ray.kill(first)  # room for a second vision worker: it grows at a checkpoint
        _history(history, 300, lambda lines: any(x["vision_workers"] == 2 for x in lines))
        # takes the CPUs of both vision workers once they stop: it restarts with 1
        second = _Placeholder.options(num_cpus=free - 1.0).remote()
        result = run.result(timeout=600)
    ray.kill(second)
    assert marker.exists()  # vision rank 1 died at step 10
    sizes = [x["vision_workers"] for x in _history(history, 1, lambda lines: True)]
    assert [k for k, _ in itertools.groupby(sizes)] == [1, 2, 1]
    assert result.metrics["vision_restarts"] == 1 and result.metrics["text_restarts"] == 0
    fixed = fit(spec, data, loop, vt(group(1), group(1)), tmp_path, "fixed", local=True)
    assert [int(s) for s in result.metrics_dataframe.sort_values("step")["step"]] == list(
        range(1, 13)
    )
    torch.testing.assert_close(
        torch.tensor(losses(result)), torch.tensor(losses(fixed)), rtol=1e-5, atol=0.0
    )
    assert_params_close(checkpoint_state(result.checkpoint), checkpoint_state(fixed.checkpoint))


def test_failure_while_the_group_restarts_falls_back_to_the_full_restart(
    ray_start_4_cpus, setup, tmp_path, monkeypatch
):
    """The vision worker dies at step 2 and a placeholder takes its CPUs, so its group
    cannot start again (Ray Train's start timeout, 5 s here): the group restart fails and
    every group restarts (the text group gets a new placement group) once the
    placeholder goes. The result equals an uninterrupted run bit for bit."""
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
    _, spec, data = setup
    loop = dict(LOOP, report_placement=True)
    marker, history = tmp_path / "killed", tmp_path / "fallback" / "metrics.jsonl"
    # an earlier test's workers may still be releasing theirs: a placeholder sized
    # meanwhile would leave room it must not leave
    free = every_cpu_free(30.0)
    with fault_drill(group="vision", step=2, marker=marker), ThreadPoolExecutor(1) as ex:
        run = ex.submit(fit, spec, data, loop, vt(group(1), group(1)), tmp_path, "fallback",
                        failures=3)  # fmt: skip
        first = _history(history, 300, lambda lines: len(lines) >= 1)[0]
        text_pg = first["placement"]["text rank 0"][0]
        _history(history, 300, lambda _: marker.exists())
        blocker = _Placeholder.options(num_cpus=free - 0.5).remote()  # all but the text's
        deadline = time.monotonic() + 300
        while ray.util.placement_group_table().get(text_pg, {}).get("state") != "REMOVED":
            assert time.monotonic() < deadline, "the text group was never restarted"
            time.sleep(0.1)
        ray.kill(blocker)
        result = run.result(timeout=600)
    lines = _history(history, 1, lambda lines: True)
    assert lines[-1]["placement"]["text rank 0"][0] != text_pg  # every group restarted
    assert result.metrics["vision_restarts"] == 0  # the group restart did not complete
    clean = fit(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "clean", local=True)
    assert_bit_identical(result, clean)


def test_standby_takes_the_failed_groups_place(ray_start_4_cpus, setup, tmp_path):
    """Vision 1 with a standby + text 1: the vision worker dies at step 3; the standby
    (started in the background once the groups ran) takes its place and continues from
    checkpoint 2 with the text group, which kept its workers; a new standby starts
    meanwhile. The result equals an uninterrupted run bit for bit."""
    _, spec, data = setup
    marker = tmp_path / "killed"
    vision = dataclasses.replace(group(1), standby=True)
    with fault_drill(group="vision", step=2, marker=marker):
        result = fit(spec, data, LOOP, vt(vision, group(1)), tmp_path, "standby", failures=1)
    assert marker.exists()
    m = result.metrics
    assert (m["vision_restarts"], m["vision_standby_takeovers"], m["text_restarts"]) == (1, 1, 0)
    clean = fit(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "clean", local=True)
    assert_bit_identical(result, clean)
