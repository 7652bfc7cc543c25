"""Tier 2: microbatches (gradient accumulation), the 1F1B schedule across groups and
cost-balanced assignment against the single-process model, without Ray
(``testing.local``). A kill mid-pipelined-step on Ray is in ``tests/ray/test_colocated.py``."""

import pytest
import torch

from ray_disagg import (
    DataParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from tests.helpers import (
    PIPELINE_GRIDS,
    PIPELINE_LOOP,
    assert_matches_reference,
    group,
    losses,
    run_layout,
    vt,
)

LOOP, GRIDS = PIPELINE_LOOP, PIPELINE_GRIDS


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    return HFModelSpec(config=cfg, seed=5), synthetic_samples(cfg, 16, grids=GRIDS)


@pytest.mark.parametrize(
    "vision,text,loop",
    [
        (lambda: group(1), lambda: group(1), {}),
        (lambda: group(2, DataParallel(fsdp=True)), lambda: group(1), {}),
        (
            lambda: group(2, SequenceParallel(size=2), ac=True),
            lambda: group(2, TensorParallel(size=2)),
            {"max_in_flight": 3},
        ),
    ],
    ids=["1+1", "vision-fsdp2+1", "vision-sp2-ac+text-tp2"],
)
def test_1f1b_layouts_match_single_process(setup, tmp_path, vision, text, loop):
    spec, data = setup
    loop = dict(LOOP, **loop)
    result = run_layout(spec, data, loop, vt(vision(), text()), tmp_path, "1f1b", local=True)
    assert_matches_reference(result, spec, data, loop)
    # the encoder ran microbatch i+1 before i's backward, never more than 2 alive (default)
    assert result.metrics["vision_max_in_flight"] == loop.get("max_in_flight", 2)
    assert result.metrics["text_max_in_flight"] == 1


def test_sequential_accumulation_balanced_equals_contiguous(setup, tmp_path):
    spec, data = setup
    base = dict(LOOP, schedule="sequential", report_sample_ids=True)
    runs = {}
    for assignment in ("contiguous", "balanced"):
        loop = dict(base, assignment=assignment)
        runs[assignment] = run_layout(
            spec, data, loop, vt(group(2), group(2)), tmp_path, assignment, local=True
        )
        assert_matches_reference(runs[assignment], spec, data, loop)
        assert runs[assignment].metrics["vision_max_in_flight"] == 1
    ids = {a: load_metrics(r)["sample_ids"] for a, r in runs.items()}
    for got, ref in zip(ids["balanced"], ids["contiguous"]):
        assert sorted(got) == sorted(ref) and len(set(got)) == 8  # each sample once per step
    torch.testing.assert_close(
        torch.tensor(losses(runs["balanced"])), torch.tensor(losses(runs["contiguous"])),
        rtol=1e-5, atol=0,
    )  # fmt: skip
