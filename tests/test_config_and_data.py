"""Tier 1: configs, sample validation and the M:N batch routing."""

import itertools

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    BatchPlan,
    DataParallel,
    ModuleGroup,
    SampleError,
    SequenceParallel,
    TensorParallel,
    TextBackendConfig,
    TrainLoopConfig,
    VisionBackendConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data import count_label_tokens
from ray_disagg.examples_data import digits_samples, synthetic_samples
from ray_disagg.models import get_adapter


def test_module_group_defaults_and_degrees():
    g = ModuleGroup(
        scaling_config=ScalingConfig(num_workers=4), parallelism=SequenceParallel(size=2)
    )
    assert (g.dp_size, g.model_parallel_size) == (2, 2)
    assert ModuleGroup(scaling_config=ScalingConfig(num_workers=3)).parallelism == DataParallel()
    with pytest.raises(ValueError, match="must divide the group's num_workers=3"):
        ModuleGroup(scaling_config=ScalingConfig(num_workers=3), parallelism=TensorParallel(size=2))
    with pytest.raises(ValueError, match="parallelism='fsdp' is not understood"):
        ModuleGroup(scaling_config=ScalingConfig(num_workers=1), parallelism="fsdp")
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        SequenceParallel(size=0)


def test_module_group_rejects_zero_workers():
    with pytest.raises(ValueError, match="num_workers >= 1"):
        ModuleGroup(scaling_config=ScalingConfig(num_workers=0))


def test_train_loop_config_from_dict():
    cfg = TrainLoopConfig.from_any({"max_steps": 2, "global_batch_size": 4, "lr": 0.1})
    assert cfg.lr == 0.1 and cfg.betas == (0.9, 0.999)
    with pytest.raises(ValueError, match=r"Unknown train_loop_config keys \['lrate'\]"):
        TrainLoopConfig.from_any({"max_steps": 2, "global_batch_size": 4, "lrate": 0.1})
    with pytest.raises(ValueError, match="missing required keys"):
        TrainLoopConfig.from_any({"max_steps": 2})
    with pytest.raises(ValueError, match="max_steps"):
        TrainLoopConfig(max_steps=0, global_batch_size=4)


def test_backend_configs_name_their_axes():
    assert VisionBackendConfig(mesh_shape=(2, 1)).mesh_axes == ("dp", "sp")
    assert TextBackendConfig(mesh_shape=(1, 2)).mesh_axes == ("dp", "tp")
    assert TextBackendConfig(mesh_shape=(2, 2)).world_size == 4
    with pytest.raises(ValueError, match="does not match axes"):
        TextBackendConfig(mesh_shape=(2,))


@pytest.mark.parametrize("nv,nt", list(itertools.product([1, 2, 4], [1, 2, 4])))
def test_routing_sends_every_sample_once_in_order(nv, nt):
    dp = {"vision": nv, "text": nt}
    plan = BatchPlan(num_samples=40, global_batch_size=8, dp_sizes=dp, shuffle=True)
    received = {t: [] for t in range(nt)}
    sent = []
    for v in range(nv):
        lo, hi = plan.span("vision", v)
        for t, a, b in plan.routes("vision", v, "text"):
            assert lo <= a < b <= hi
            received[t].append((v, a, b))
            sent.extend(range(a, b))
    assert sorted(sent) == list(range(8))
    for t in range(nt):
        # what text replica t receives, in vision order, is exactly its span, contiguous
        assert received[t] == plan.routes("text", t, "vision")
        pos = [p for _, a, b in received[t] for p in range(a, b)]
        assert pos == list(range(*plan.span("text", t)))


def test_epochs_cover_every_sample_once():
    plan = BatchPlan(num_samples=10, global_batch_size=4, dp_sizes={"a": 2}, shuffle=True)
    assert plan.steps_per_epoch == 2
    epoch0 = plan.global_indices(0) + plan.global_indices(1)
    assert len(set(epoch0)) == 8
    assert plan.global_indices(2) != plan.global_indices(0)  # reshuffled next epoch
    assert plan.global_indices(0) == BatchPlan(10, 4, {"b": 4}, shuffle=True).global_indices(0)


def test_batch_plan_errors():
    with pytest.raises(ValueError, match="not divisible by the text group's data-parallel size 4"):
        BatchPlan(num_samples=10, global_batch_size=6, dp_sizes={"vision": 2, "text": 4})
    with pytest.raises(ValueError, match="fewer than global_batch_size"):
        BatchPlan(num_samples=3, global_batch_size=4, dp_sizes={"vision": 1, "text": 1})


def test_validate_sample_names_the_sample():
    cfg = tiny_qwen2_5_vl_config()
    validate_sample = get_adapter(cfg).validate_sample
    (s,) = synthetic_samples(cfg, 1)
    validate_sample(s)
    bad = dict(s, input_ids=np.concatenate([s["input_ids"], [100]]), labels=None, id="cat-17")
    with pytest.raises(SampleError, match=r"sample 'cat-17': 5 image tokens .* give 4 embeddings"):
        validate_sample(bad)
    with pytest.raises(SampleError, match=r"needs \(16, 96\)"):
        validate_sample(dict(s, pixel_values=s["pixel_values"][:3]))
    with pytest.raises(SampleError, match="both 'pixel_values' and 'image_grid_thw'"):
        validate_sample(dict(s, pixel_values=None))


def test_collate_pads_right_and_counts_labels():
    cfg = tiny_qwen2_5_vl_config()
    adapter = get_adapter(cfg)
    samples = synthetic_samples(cfg, 3, grids=[(1, 4, 4), None, (1, 8, 4)])
    batch = adapter.collate_llm(samples)
    assert batch["input_ids"].shape == (3, max(len(s["input_ids"]) for s in samples))
    assert batch["attention_mask"].sum().item() == sum(len(s["input_ids"]) for s in samples)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 4]]
    assert batch["video_grid_thw"] is None
    n = sum(count_label_tokens(adapter.labels(s)) for s in samples)
    assert n == int((batch["labels"][:, 1:] != -100).sum())


def test_digits_samples_use_the_real_image_processor():
    cfg = tiny_qwen2_5_vl_config()
    samples = digits_samples(cfg, n=3)
    for s in samples:
        get_adapter(cfg).validate_sample(s)
        assert s["image_grid_thw"].tolist() == [[1, 4, 4]]
        assert s["pixel_values"].shape == (16, 3 * 2 * 4 * 4)
    assert (s["labels"] != -100).sum() == 4  # "a handwritten <digit>" + eos
