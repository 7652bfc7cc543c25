"""Tier 2: every layout's workers (the very loops Ray Train runs, on gloo process groups
and the real channel, without Ray: ``ray_disagg.testing.local``) equal the single-process
HF model. Ray's part (placement, restarts, checkpoints through Ray Train) is tier 3."""

import math

import pytest
import torch

from ray_disagg import (
    ContextParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.reference import reference_train
from tests.helpers import assert_matches_reference, checkpoint_state, group, run_layout, vt

# eps=1e-6 keeps AdamW from turning float noise in ~0 gradients into +-lr steps.
LOOP = {
    "max_steps": 3,
    "global_batch_size": 4,
    "lr": 1e-3,
    "eps": 1e-6,
    "seed": 3,
}
# Varied image sizes (ragged cu_seqlens) and one text-only sample.
GRIDS = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8), (1, 8, 8), (1, 4, 4)]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    return HFModelSpec(config=cfg, seed=7), synthetic_samples(cfg, 12, grids=GRIDS)


# 1 + 1 runs in gloo/test_pipeline, gloo/test_fsdp_layouts and on Ray (ray/test_colocated)
@pytest.mark.parametrize("nv,nt", [(2, 2), (2, 1), (1, 2)])
def test_data_parallel_layouts_match_single_process(setup, tmp_path, nv, nt):
    spec, data = setup
    if (nv, nt) == (2, 1):
        # Also the from_pretrained path: every worker loads a local save_pretrained dir.
        spec.build_full().save_pretrained(tmp_path / "hf")
        spec = HFModelSpec(pretrained_path=tmp_path / "hf")
    ac = (nv, nt) == (2, 2)  # activation checkpointing must not change the numbers
    loop = dict(LOOP, checkpoint_every=1)
    result = run_layout(
        spec,
        data,
        loop,
        vt(group(nv, ac=ac), group(nt, ac=ac)),
        tmp_path,
        f"dp-{nv}-{nt}",
        local=True,
    )
    assert_matches_reference(result, spec, data, loop)
    assert sorted(p.name for p in (tmp_path / f"dp-{nv}-{nt}").glob("checkpoint_0*")) == [
        "checkpoint_000001",
        "checkpoint_000002",
        "checkpoint_000003",
    ]
    for key in ("loss", "tokens_per_s", "vision_compute_s", "text_compute_s", "images", "videos"):
        assert key in result.metrics


@pytest.mark.parametrize(
    "vision,text",
    [
        (lambda: group(2, SequenceParallel(size=2)), lambda: group(2, TensorParallel(size=2))),
        (
            lambda: group(4, SequenceParallel(size=2, zero1=True), cpus=0.25, ac=True),
            lambda: group(2, TensorParallel(size=2), ac=True),
        ),
        (lambda: group(2, TensorParallel(size=2)), lambda: group(2, TensorParallel(size=2))),
        (lambda: group(2), lambda: group(2, ContextParallel(size=2))),
    ],
    ids=["vision-sp2+text-tp2", "vision-dp2xsp2-zero1+text-tp2", "uniform-tp2", "2+text-cp2"],
)
def test_hybrid_layouts_match_single_process(setup, tmp_path, vision, text):
    spec, data = setup
    result = run_layout(spec, data, LOOP, vt(vision(), text()), tmp_path, "hybrid", local=True)
    assert_matches_reference(result, spec, data, LOOP)


def test_bf16_autocast_trains_close_to_fp32(setup, tmp_path):
    spec, data = setup
    loop = dict(LOOP, bf16=True)
    vision, text = group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2))
    result = run_layout(spec, data, loop, vt(vision, text), tmp_path, "bf16", local=True)
    ref_losses, _, _ = reference_train(spec, data, TrainLoopConfig(**LOOP))
    losses = load_metrics(result)["loss"].tolist()
    # bf16 matmuls, fp32 master weights (checkpointed weights stay fp32)
    assert all(math.isfinite(v) for v in losses)
    for got, ref in zip(losses, ref_losses):
        assert abs(got - ref) / ref < 2e-2, (losses, ref_losses)
    assert all(t.dtype == torch.float32 for t in checkpoint_state(result.checkpoint).values())
