"""Tier 3: colocated placement (one placement group, bundle i holds worker i of every
group) and the transfer tiers, on a real Ray cluster, against the single-process model."""

import pytest
import torch

from ray_disagg import (
    ContextParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.faults import fault_drill
from tests.helpers import (
    assert_matches_reference,
    checkpoint_state,
    group,
    losses,
    run_layout,
    vt,
)

LOOP = {
    "max_steps": 4,
    "global_batch_size": 4,
    "checkpoint_every": 1,
    "lr": 1e-3,
    "eps": 1e-6,
    "seed": 5,
    "report_placement": True,
}
GRIDS = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8), (1, 8, 8)]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    return HFModelSpec(config=cfg, seed=11), synthetic_samples(cfg, 8, grids=GRIDS)


@pytest.fixture(scope="module")
def colocated_1_1(ray_start_4_cpus, setup, tmp_path_factory):
    """The uninterrupted colocated 1 + 1 run over the (automatic) shared-memory tier."""
    spec, data = setup
    root = tmp_path_factory.mktemp("colocated")
    groups = vt(group(1), group(1))
    return run_layout(spec, data, LOOP, groups, root, "shm", placement="colocated")


def assert_paired_in_one_placement_group(metrics, n: int) -> None:
    """Seen from inside the workers: one placement group; vision rank i and text rank i
    in bundle i."""
    placement = metrics["placement"]
    assert len(placement) == 2 * n
    assert len({pg for pg, _ in placement.values()}) == 1
    for i in range(n):
        assert placement[f"vision rank {i}"][1] == placement[f"text rank {i}"][1] == i


@pytest.mark.parametrize(
    "vision,text",
    [
        (lambda: group(2), lambda: group(2, ContextParallel(size=2))),
        (lambda: group(2, SequenceParallel(size=2)), lambda: group(2, TensorParallel(size=2))),
    ],
    ids=["2+text-cp2", "vision-dp1xsp2+text-tp2"],
)
def test_colocated_layouts_match_single_process(ray_start_4_cpus, setup, tmp_path, vision, text):
    spec, data = setup
    result = run_layout(
        spec, data, LOOP, vt(vision(), text()), tmp_path, "co", placement="colocated"
    )
    assert_matches_reference(result, spec, data, LOOP)
    assert_paired_in_one_placement_group(result.metrics, 2)
    assert result.metrics["transfer_tier"] == "shm"


def test_colocated_1_1_matches_single_process(colocated_1_1, setup):
    spec, data = setup
    assert_matches_reference(colocated_1_1, spec, data, LOOP)
    assert_paired_in_one_placement_group(colocated_1_1.metrics, 1)
    assert colocated_1_1.metrics["transfer_tier"] == "shm"


def test_killed_colocated_worker_restarts_its_group_alone_over_the_gloo_tier(
    colocated_1_1, setup, tmp_path
):
    """The vision group restarts alone into the shared bundles; the text group keeps its
    worker. Also the gloo tier (forced): it trains bit-identically to shared memory."""
    spec, data = setup
    marker = tmp_path / "killed"
    groups = vt(group(1), group(1))
    with fault_drill(group="vision", step=2, marker=marker):
        result = run_layout(
            spec,
            data,
            LOOP,
            groups,
            tmp_path,
            "kill",
            failures=1,
            placement="colocated",
            transfer="gloo",
        )
    assert result.metrics["transfer_tier"] == "gloo"
    assert marker.exists()  # the vision worker really died in step 3, after checkpoint 2
    assert [int(s) for s in result.metrics_dataframe.sort_values("step")["step"]] == [1, 2, 3, 4]
    assert losses(result) == losses(colocated_1_1)  # bit-identical on CPU
    got, ref = checkpoint_state(result.checkpoint), checkpoint_state(colocated_1_1.checkpoint)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert_paired_in_one_placement_group(result.metrics, 1)  # in the shared bundles
    assert result.metrics["vision_restarts"] == 1 and result.metrics["text_restarts"] == 0
