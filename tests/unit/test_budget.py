"""Tier 1: token-budget batching (``max_tokens_per_microbatch``): the steps' bins, the plan
the workers follow, and the settings the driver refuses."""

import dataclasses

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.config.layout import DataSpec, resolve
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models.packing import pack_rows
from ray_disagg.pipeline.bins import BinFiller, fill_epoch, fill_steps
from ray_disagg.pipeline.budget import BudgetPlan, StreamBudgetPlan

CFG = tiny_qwen2_5_vl_config()
# mostly short text, some images, one video (39 LLM tokens, 128 patches) in eight
GRIDS = [None, (1, 4, 4), None, None, {"videos": [(2, 8, 8)]}, (1, 4, 8), None, (1, 8, 8)]
LOOP = {"max_steps": 2, "global_batch_size": 16, "max_tokens_per_microbatch": 48}


def skewed(n=400, seed=0):
    """``(lengths, patches)``: short samples and a few long videos."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, 40, n)
    tokens[rng.random(n) < 0.05] = 300
    patches = np.where(tokens > 100, 900, rng.integers(0, 200, n))
    return [(int(t),) for t in tokens], {"vision": patches.astype(float)}


@pytest.mark.parametrize("packed", [None, 320])
def test_every_bin_within_the_budget_and_every_sample_once_per_epoch(packed):
    lengths, patches = skewed()
    kw = dict(max_tokens=640, max_patches=1000, micro_batches=2, llm_dp=2,
              encoder_dps={"vision": 3}, max_samples=64, max_seq_len=packed)  # fmt: skip
    order = np.random.default_rng(1).permutation(len(lengths)).tolist()
    steps = fill_epoch(order, lengths, patches, **kw)
    assert steps == fill_epoch(order, lengths, patches, **kw)  # deterministic
    seen = [i for s in steps for i in s.indices()]
    assert len(seen) == len(set(seen)) and len(seen) > 0.95 * len(lengths)
    counts = [s.count for s in steps]
    assert max(counts) <= 64 and len(set(counts)) > 3  # the count follows the lengths
    for s in steps:
        assert all(b for mb in s.llm for b in mb)  # every microbatch of every replica
        for j, mb in enumerate(s.llm):
            for b in mb:  # the batch the collate makes, padding included
                n = [lengths[i][0] for i in b]
                rows = pack_rows(n, packed) if packed else [[r] for r in range(len(n))]
                assert len(rows) * max(sum(n[r] for r in row) for row in rows) <= 640
            union = sorted(i for b in mb for i in b)  # each encoder splits the microbatch
            assert sorted(i for b in s.encoders["vision"][j] for i in b) == union
            assert all(sum(patches["vision"][i] for i in b) <= 1000
                       for b in s.encoders["vision"][j])  # fmt: skip


def test_similar_lengths_share_a_microbatch_and_the_count_cap_fills_every_bin():
    lengths = [(30,), (2,), (30,), (2,), (3,), (2,), (30,), (30,)] + [(1,)] * 56
    steps = fill_epoch(range(64), lengths, {}, max_tokens=64, max_patches=None,
                       micro_batches=1, llm_dp=4, encoder_dps={}, max_samples=8)  # fmt: skip
    first = steps[0].llm[0]
    assert [len(b) for b in first] == [2, 2, 2, 2]  # 8 samples, none left empty
    assert sorted(sorted(lengths[i][0] for i in b) for b in first) == [
        [2, 2], [2, 3], [30, 30], [30, 30]]  # padded: 4 + 6 + 60 + 60 tokens  # fmt: skip


def test_plan_locates_steps_over_shuffled_epochs_and_assigns_positions():
    lengths, patches = skewed(120)
    plan = BudgetPlan(num_samples=120, global_batch_size=32, dp_sizes={"vision": 2, "text": 2},
                      seed=3, shuffle=True, micro_batches=2, reader="text", max_tokens=320,
                      lengths=lengths, patches=patches)  # fmt: skip
    per_epoch = [len(plan.epoch_steps(e)) for e in range(3)]
    assert len(set(per_epoch)) > 1 or per_epoch[0] > 1
    step = per_epoch[0]  # the first step of epoch 1
    assert [plan.epoch_of(s) for s in (0, step - 1, step)] == [0, 0, 1]
    assert plan.global_indices(step) == plan.epoch_steps(1)[0].indices()
    for s in range(sum(per_epoch[:2])):
        n = len(plan.global_indices(s))
        mbs = plan.assign(s)
        for group in ("text", "vision"):
            got = sorted(p for mb in mbs for share in mb[group] for p in share)
            assert got == list(range(n))  # every position once, in each group
        assert plan.peers("vision", 0, "text", s) == plan.peers("vision", 0, "text", s, mbs)


def test_a_covering_pass_places_every_sample_and_a_binding_cap_is_refused():
    lengths, patches = skewed(50)
    shape = (2, 2, {"vision": 1})
    filler = BinFiller(lengths, patches, 640, 1000, 64, shape)
    steps = fill_steps(filler, range(50), cover=True)
    assert {i for s in steps for i in s.indices()} == set(range(50))  # some repeated last
    assert all(s.every_bin_used for s in steps)
    plan = BudgetPlan(num_samples=50, global_batch_size=64, dp_sizes={"vision": 1, "text": 2},
                      micro_batches=2, reader="text", max_tokens=640, max_patches=1000,
                      lengths=lengths, patches=patches)  # fmt: skip
    covering = dataclasses.replace(plan, cover=True)  # DPO's reference pass
    seen = {i for s in range(covering.steps_per_epoch) for i in covering.global_indices(s)}
    assert seen == set(range(50)) > {i for s in plan.epoch_steps(0) for i in s.indices()}
    # one vision replica for two LLM replicas, room for one image per microbatch: most
    # samples (all with images) cannot share a step
    kw = dict(num_samples=40, global_batch_size=8, dp_sizes={"vision": 1, "text": 2},
              reader="text", max_tokens=64, max_patches=100, lengths=[(10,)] * 40)  # fmt: skip
    with pytest.raises(ValueError, match=r"of the 40 training samples fit no step.*raise the"):
        BudgetPlan(**kw, patches={"vision": np.full(40, 60.0)})


@pytest.mark.parametrize("vision_dp", [1, 2, 4])
def test_a_streams_patch_cap_holds_on_every_encoder_replica(vision_dp):
    """Each LLM leader fills its own bins; with a cap each encoder replica serves fixed
    leaders, whose bins hold the cap over how many it serves."""
    plan = StreamBudgetPlan(num_samples=100, global_batch_size=24, max_tokens=64,
                            dp_sizes={"vision": vision_dp, "text": 3}, max_patches=90,
                            micro_batches=2, reader="text")  # fmt: skip
    cap = plan.caps()["vision"]
    assert cap == {1: 30, 2: 45, 4: 90}[vision_dp] and plan.epoch_of(7) == 0
    rng = np.random.default_rng(0)
    counts = [[int(rng.integers(1, 4)) for _ in range(2)] for _ in range(3)]
    n = sum(map(sum, counts))
    patches = rng.integers(0, cap // 3 + 1, n).astype(float)  # at most 3 per bin: <= cap
    mbs = plan.assign(0, {"counts": counts, "costs": {"vision": patches, "text": patches}})
    for mb in mbs:
        assert sorted(p for s in mb["vision"] for p in s) == sorted(
            p for s in mb["text"] for p in s
        )
        assert all(sum(patches[p] for p in share) <= 90 for share in mb["vision"])


def make(loop, data=None, groups=None):
    g = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    return DisaggregatedTrainer(
        model=HFModelSpec(config=CFG),
        groups=groups or {"vision": g, "text": g},
        train_loop_config=loop,
        datasets={"train": data or synthetic_samples(CFG, 16, grids=GRIDS)},
    )


def test_the_trainer_plans_by_budget():
    plan = make(LOOP | {"micro_batches": 2, "max_patches_per_microbatch": 128}).plan
    assert isinstance(plan, BudgetPlan) and plan.max_patches == 128
    assert list(plan.patches) == ["vision"] and int(plan.patches["vision"][4]) == 128


@pytest.mark.parametrize(
    "loop,match",
    [
        ({"max_tokens_per_microbatch": 38}, r"sample 4 has 39 LLM tokens.*1 rows x 39.*=38"),
        (
            {"max_patches_per_microbatch": 100},
            r"sample 4 has 128 vision patches, more than 100 \(max_patches_per_microbatch\): no",
        ),
        ({"global_batch_size": 1, "micro_batches": 2}, r"global_batch_size=1 is below the 2"),
    ],
)
def test_samples_over_the_budget_are_refused_naming_them(loop, match):
    with pytest.raises(ValueError, match=match):
        make(LOOP | loop)


@pytest.mark.parametrize(
    "loop,match",
    [
        ({"pack_sequences": True, "max_seq_len": 64}, r"=48 is below max_seq_len=64"),
        (
            {"max_tokens_per_microbatch": None, "max_patches_per_microbatch": 8},
            r"set 'max_tokens_per_microbatch' too",
        ),
    ],
)
def test_budget_settings_refused(loop, match):
    with pytest.raises(ValueError, match=match):
        TrainLoopConfig(**LOOP | loop)


def test_budget_needs_sizes_per_step_and_a_fixed_size_for_a_patch_cap():
    spec, one = HFModelSpec(config=CFG), ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    resolve(spec, {"vision": one, "text": one}, LOOP, data=DataSpec(kind="stream"))
    with pytest.raises(ValueError, match=r"a ray.data.Dataset split.*or a ConversationStream"):
        resolve(spec, {"vision": one, "text": one}, LOOP, data=DataSpec(kind="ray"))
    elastic = ModuleGroup(scaling_config=ScalingConfig(num_workers=(1, 3)))
    loop = LOOP | {"checkpoint_every": 1}
    layout = resolve(spec, {"vision": elastic, "text": one}, loop, data=DataSpec(kind="map"))
    assert layout.elastic_sizes == {"vision": [1, 2, 3]}  # any size splits a filled step
    with pytest.raises(ValueError, match=r"change with the elastic group\(s\) \['vision'\]"):
        capped = loop | {"max_patches_per_microbatch": 256}
        resolve(spec, {"vision": elastic, "text": one}, capped, data=DataSpec(kind="map"))
