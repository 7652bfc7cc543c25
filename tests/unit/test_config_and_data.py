"""Tier 1: configs, sample validation and the M:N batch routing."""

import itertools

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    BatchPlan,
    DataParallel,
    ModuleBackendConfig,
    ModuleGroup,
    SampleError,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import digits_samples, synthetic_samples
from ray_disagg.models import get_adapter
from ray_disagg.pipeline.assignment import balanced_split, count_label_tokens


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
    with pytest.raises(ValueError, match=r"SequenceParallel\(size=0\): must be an int >= 1"):
        SequenceParallel(size=0)


def test_module_group_rejects_zero_workers_and_takes_elastic_ranges():
    with pytest.raises(ValueError, match="num_workers >= 1"):
        ModuleGroup(scaling_config=ScalingConfig(num_workers=0))
    with pytest.raises(ValueError, match="num_workers >= 1"):
        ModuleGroup(scaling_config=ScalingConfig(num_workers=(0, 2)))
    g = ModuleGroup(scaling_config=ScalingConfig(num_workers=(1, 4)))
    assert g.elastic and g.num_workers == 1
    fixed = g.at_size(2)
    assert not fixed.elastic and (fixed.num_workers, fixed.dp_size) == (2, 2)
    assert fixed.scaling_config.elastic_resize_monitor_interval_s == 60.0  # kept


def test_elastic_sizes_divide_the_microbatch_share(caplog):
    from ray_disagg.launch.recovery.elastic import ElasticGroup, allowed_sizes, elastic_sizes

    cfg = TrainLoopConfig(max_steps=2, global_batch_size=8, micro_batches=2, checkpoint_every=1)
    with caplog.at_level("INFO"):
        assert elastic_sizes({"vision": (1, 4)}, cfg) == {"vision": [1, 2, 4]}
    assert "not [3]" in caplog.text and "the 4 samples of a microbatch" in caplog.text
    with pytest.raises(ValueError, match=r"no size in that range divides the 4 .*\[1, 2, 4\]"):
        elastic_sizes({"vision": (3, 3)}, cfg)
    no_ckpt = TrainLoopConfig(max_steps=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"set train_loop_config\['checkpoint_every'\]"):
        elastic_sizes({"vision": (1, 2)}, no_ckpt)
    assert allowed_sizes(2, 8, 8) == [2, 4, 8]
    group = ElasticGroup(name="vision", launches=dict.fromkeys([1, 2, 4]), per_worker={"CPU": 1})
    assert group.fitting(3) == 2 and group.fitting(0) is None
    # 4 free CPUs, 1.5 of them for the other groups: 2 vision workers
    assert group.initial_size({"CPU": 4.0}, {"CPU": 1.5}) == 2
    assert group.initial_size({"CPU": 1.0}, {"CPU": 1.5}) == 1  # the smallest: it waits


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
    vision = ModuleBackendConfig(module="vision", mesh_shape=(2, 1), mesh_axes=("dp", "sp"))
    assert (vision.module, vision.mesh_axes, vision.world_size) == ("vision", ("dp", "sp"), 2)
    assert ModuleBackendConfig(mesh_shape=(2, 2), mesh_axes=("dp", "tp")).world_size == 4
    with pytest.raises(ValueError, match="does not match axes"):
        ModuleBackendConfig(mesh_shape=(2,), mesh_axes=("dp", "tp"))
    with pytest.raises(ValueError, match="must be positive"):
        ModuleBackendConfig(mesh_shape=(0, 1))


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


def _plan(nv, nt, k, costs=None, n=32, b=8):
    return BatchPlan(
        num_samples=n,
        global_batch_size=b,
        dp_sizes={"vision": nv, "text": nt},
        shuffle=True,
        micro_batches=k,
        reader="text",
        costs=costs,
    )


def _skewed_costs(n=32):
    rng = np.random.default_rng(0)
    vision = rng.integers(1, 10, n).astype(float)
    vision[::8] = 400.0  # one large image per 8 samples
    return {"vision": vision + vision**2 / 1024, "text": rng.integers(5, 50, n).astype(float)}


@pytest.mark.parametrize("nv,nt,k", [(1, 1, 4), (2, 1, 4), (2, 2, 2), (4, 2, 1), (1, 2, 2)])
@pytest.mark.parametrize("balanced", [False, True])
def test_assignment_uses_every_sample_once_per_group_and_microbatch(nv, nt, k, balanced):
    plan = _plan(nv, nt, k, _skewed_costs() if balanced else None)
    for step in range(5):
        mbs = plan.assign(step)
        assert mbs == plan.assign(step)  # deterministic (restart-safe)
        assert len(mbs) == k
        for group, n in (("vision", nv), ("text", nt)):
            positions = [p for mb in mbs for r in range(n) for p in mb[group][r]]
            assert sorted(positions) == list(range(8))  # every sample exactly once
            for mb in mbs:  # in position order; the reader's counts equal, none empty
                assert all(mb[group][r] == sorted(mb[group][r]) for r in range(n))
                if group == "text" or not balanced:  # balanced encoders: counts free
                    assert all(mb[group][r] for r in range(n))
                    assert len({len(mb[group][r]) for r in range(n)}) == 1
        for mb in mbs:  # a microbatch is the same samples for every group
            assert sorted(p for s in mb["vision"] for p in s) == sorted(
                p for s in mb["text"] for p in s
            )


def test_contiguous_single_microbatch_assignment_is_the_spans():
    plan = _plan(4, 2, 1)
    (mb,) = plan.assign(3)
    for group, n in (("vision", 4), ("text", 2)):
        assert [mb[group][r] for r in range(n)] == [
            list(range(*plan.span(group, r))) for r in range(n)
        ]


def test_balanced_assignment_evens_out_encoder_cost():
    costs = _skewed_costs()
    costs["vision"][1::8] = costs["vision"][0::8]  # two large images in each batch of 8
    plans = [
        BatchPlan(32, 8, {"vision": 2, "text": 1}, reader="text", costs=c) for c in (costs, None)
    ]

    def worst(plan, step):
        idx = plan.global_indices(step)
        (mb,) = plan.assign(step)
        return max(sum(costs["vision"][idx[p]] for p in share) for share in mb["vision"])

    for step in range(4):  # contiguous: both large images on replica 0; balanced: one each
        assert worst(plans[0], step) <= 0.6 * worst(plans[1], step)
    # one large image and seven small ones: the large one alone on a replica
    one_large = {"vision": np.array([7.0] + [1.0] * 7), "text": np.ones(8)}
    (mb,) = BatchPlan(8, 8, {"vision": 2, "text": 1}, reader="text", costs=one_large).assign(0)
    assert mb["vision"] == [[0], [1, 2, 3, 4, 5, 6, 7]]


def test_balanced_split_is_longest_processing_time():
    assert balanced_split([0, 1, 2, 3, 4, 5], [10, 1, 1, 1, 9, 2], 2) == [[0, 1, 2], [3, 4, 5]]
    free = balanced_split([0, 1, 2, 3, 4, 5], [10, 1, 1, 1, 9, 2], 2, equal_counts=False)
    assert free == [[0, 1, 2], [3, 4, 5]]  # loads 12 and 12
    # zero costs (text-only samples) still spread over every list
    assert balanced_split([0, 1, 2, 3], [0.0] * 4, 2, equal_counts=False) == [[0, 2], [1, 3]]


def test_micro_batches_must_divide_each_replicas_share():
    with pytest.raises(ValueError, match="vision group's data-parallel size 2 x micro_batches=4"):
        BatchPlan(num_samples=16, global_batch_size=4, dp_sizes={"vision": 2}, micro_batches=4)
    with pytest.raises(ValueError, match=r"micro_batches'\]=0"):
        TrainLoopConfig(max_steps=1, global_batch_size=4, micro_batches=0)
    with pytest.raises(ValueError, match="schedule"):
        TrainLoopConfig(max_steps=1, global_batch_size=4, schedule="gpipe")
    with pytest.raises(ValueError, match="assignment"):
        TrainLoopConfig(max_steps=1, global_batch_size=4, assignment="random")


@pytest.mark.parametrize("balanced", [False, True])
def test_both_sides_agree_on_who_exchanges_messages(balanced):
    plan = _plan(2, 4, 2, _skewed_costs() if balanced else None, b=16)
    pairs = plan.exchange_pairs("vision", "text")
    for step in range(4):
        for d in range(2):
            for t in range(4):
                sends = d in plan.peers("text", t, "vision", step)
                assert sends == (t in plan.peers("vision", d, "text", step))
                assert not sends or (d, t) in pairs
    if not balanced:  # contiguous slices: only overlapping replicas ever talk
        assert pairs == {(0, 0), (0, 1), (1, 2), (1, 3)}


def test_a_balanced_stream_splits_the_encoders_by_each_steps_costs():
    """Costs that arrive with a stream's step: the reader keeps contiguous shares (its
    replicas read their own records), the vision replicas are balanced by those costs,
    and the reader talks to every vision replica."""
    plan = BatchPlan(32, 8, {"vision": 2, "text": 2}, reader="text", streamed_costs=True)
    step_costs = {"vision": np.array([9.0, 9.0, 1, 1, 1, 1, 1, 1]), "text": np.ones(8)}
    (mb,) = plan.assign(0, step_costs)
    assert mb["text"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(len({0, 1} & set(share)) for share in mb["vision"]) == [1, 1]
    (contiguous,) = plan.assign(0)  # without the step's costs: contiguous
    assert contiguous["vision"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.peers("text", 0, "vision", 0) == [0, 1] == plan.peers("vision", 1, "text", 0)
    assert plan.exchange_pairs("vision", "text") == {(a, b) for a in range(2) for b in range(2)}
