"""Tier 3: colocated placement (one placement group, bundle i holds worker i of every
group), the automatic shared-memory tier, the 1F1B schedule and a group restarted alone,
on a real Ray cluster: a vision worker killed mid-pipelined-step, against the same
layout's uninterrupted run without Ray over the gloo tier (forced) and the
single-process model. The other layouts' numerics, colocated or not, are in the gloo tier
(``tests/gloo/test_layouts_match_single_process.py``, ``tests/gloo/test_pipeline.py``)."""

import pytest

from ray_disagg import HFModelSpec, TensorParallel, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.faults import fault_drill
from tests.helpers import (
    PIPELINE_GRIDS,
    PIPELINE_LOOP,
    assert_bit_identical,
    assert_matches_reference,
    group,
    run_layout,
    vt,
)

LOOP = dict(PIPELINE_LOOP, seed=5, report_placement=True)  # 1F1B across the groups
GRIDS = PIPELINE_GRIDS


def _groups():
    """Vision 2 + text TP2: both text ranks leave a step together when a vision rank dies."""
    return vt(group(2), group(2, TensorParallel(size=2)))


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    return HFModelSpec(config=cfg, seed=11), synthetic_samples(cfg, 16, grids=GRIDS)


def assert_paired_in_one_placement_group(metrics, n: int) -> None:
    """Seen from inside the workers: one placement group; vision rank i and text rank i
    in bundle i."""
    placement = metrics["placement"]
    assert len(placement) == 2 * n
    assert len({pg for pg, _ in placement.values()}) == 1
    for i in range(n):
        assert placement[f"vision rank {i}"][1] == placement[f"text rank {i}"][1] == i


def test_killed_mid_pipelined_step_restarts_its_group_alone_in_the_shared_bundles(
    ray_start_4_cpus, setup, tmp_path
):
    """Vision rank 1 dies at microbatch 2 of step 3: only the vision group restarts (into
    the shared bundles); both text ranks leave the step together, keep their workers and
    reload checkpoint 2 in place. The tensors between the groups go over shared memory
    (chosen automatically for colocated workers on one node); the result equals the
    uninterrupted run without Ray over the gloo tier (forced) bit for bit, and the
    single-process model."""
    spec, data = setup
    marker = tmp_path / "killed"
    with fault_drill(group="vision", step=2, rank=1, micro_batch=2, marker=marker):
        result = run_layout(
            spec, data, LOOP, _groups(), tmp_path, "kill", failures=1, placement="colocated"
        )
    assert marker.exists()  # vision rank 1 really died at microbatch 2 of step 3
    assert result.metrics["transfer_tier"] == "shm"
    assert result.metrics["vision_restarts"] == 1 and result.metrics["text_restarts"] == 0
    assert [int(s) for s in result.metrics_dataframe.sort_values("step")["step"]] == [1, 2, 3]
    assert_paired_in_one_placement_group(result.metrics, 2)  # in the shared bundles
    clean = run_layout(spec, data, LOOP, _groups(), tmp_path, "clean", local=True,
                       placement="colocated", transfer="gloo")  # fmt: skip
    assert clean.metrics["transfer_tier"] == "gloo"
    assert_bit_identical(result, clean)
    assert_matches_reference(clean, spec, data, LOOP)
