"""Tier 1: learning-rate schedules, freezing, validation sets and packing settings: their
arithmetic, and the errors a wrong setting raises on the driver (no worker starts)."""

import math

import pytest
import torch
from ray.train import ScalingConfig

from ray_disagg import (
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    TrainLoopConfig,
    lr_at,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.config.freezing import apply_freeze, is_frozen
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models.qwen_common.parallelize import SplitQKV
from ray_disagg.parallel.data_parallel import all_reduce_gradients
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.reporting import is_reported_step

CFG = tiny_qwen2_5_vl_config()
DATA = synthetic_samples(CFG, 8)
LOOP = {"max_steps": 3, "global_batch_size": 4}


def g(**kwargs):
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=1), **kwargs)


def make(vision=None, text=None, loop=None, val=None):
    datasets = {"train": DATA} if val is None else {"train": DATA, "validation": val}
    return DisaggregatedTrainer(
        model=HFModelSpec(config=CFG),
        groups={"vision": vision or g(), "text": text or g()},
        train_loop_config=dict(LOOP, **(loop or {})),
        datasets=datasets,
    )


def test_schedules_warm_up_then_decay_to_the_floor():
    def lrs(**kw):
        cfg = TrainLoopConfig(max_steps=6, global_batch_size=1, lr=1.0, **kw)
        return [lr_at(cfg, s) for s in range(6)]

    assert lrs() == [1.0] * 6
    assert lrs(warmup_steps=2) == [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0]
    linear = lrs(lr_schedule="linear", warmup_steps=1, min_lr_ratio=0.2)
    assert linear[:2] == [0.5, 1.0] and linear[-1] == pytest.approx(0.2)
    assert all(a > b for a, b in zip(linear[1:], linear[2:]))
    cosine = lrs(lr_schedule="cosine", min_lr_ratio=0.1)
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.1)
    assert cosine[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 5)))
    cfg = TrainLoopConfig(max_steps=6, global_batch_size=1, lr=1.0, lr_schedule="cosine")
    assert lr_at(cfg, 2, multiplier=0.1) == pytest.approx(0.1 * lr_at(cfg, 2))


@pytest.mark.parametrize(
    "loop,match",
    [
        ({"lr_schedule": "step"}, r"lr_schedule.*one of \('constant', 'linear', 'cosine'\)"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"eval_every": 0}, "eval_every"),
        ({"pack_sequences": True}, "needs 'max_seq_len'"),
        ({"pack_sequences": "yes", "max_seq_len": 8}, "pack_sequences"),
        ({"max_seq_len": 1}, "max_seq_len"),
    ],
)
def test_bad_loop_settings(loop, match):
    with pytest.raises(ValueError, match=match):
        TrainLoopConfig(**dict(LOOP, **loop))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"trainable": "no"}, "trainable"),
        ({"freeze": [""]}, "freeze"),
        ({"freeze": 3}, "freeze"),
        ({"lr_multiplier": -1.0}, "lr_multiplier"),
        ({"lr_multiplier": float("nan")}, "lr_multiplier"),
    ],
)
def test_bad_group_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        g(**kwargs)


def test_freeze_prefixes_match_whole_name_components():
    group = g(freeze=["model.visual.blocks.1"])
    assert is_frozen("model.visual.blocks.1.mlp.up_proj.weight", group)
    assert not is_frozen("model.visual.blocks.10.mlp.up_proj.weight", group)
    assert not is_frozen("model.visual.merger.mlp.0.weight", group)
    assert is_frozen("anything", g(trainable=False))
    model = HFModelSpec(config=CFG).meta_model("vision")
    n = apply_freeze(model, g(freeze=["model.visual.blocks"]))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert n > 0 and trainable and all(not t.startswith("model.visual.blocks") for t in trainable)


def test_freezing_is_checked_on_the_driver():
    with pytest.raises(ValueError, match=r"groups\['vision'\].freeze: 'model.visul'"):
        make(vision=g(freeze=["model.visul"]))
    with pytest.raises(ValueError, match="nothing to train"):
        make(vision=g(trainable=False), text=g(freeze=["model", "lm_head"]))
    assert make(vision=g(trainable=False)).frozen_parts == ("vision",)
    # freezing every parameter by prefix is the same as trainable=False
    assert make(vision=g(freeze=["model.visual"])).frozen_parts == ("vision",)
    assert make(vision=g(freeze=["model.visual.blocks"])).frozen_parts == ()


def test_validation_set_is_checked_on_the_driver():
    with pytest.raises(ValueError, match="no validation set"):
        make(loop={"eval_every": 2})
    with pytest.raises(ValueError, match="fewer than global_batch_size=4"):
        make(val=DATA[:3])
    with pytest.raises(ValueError, match="extra keys"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": g(), "text": g()},
            train_loop_config=LOOP,
            datasets={"train": DATA, "test": DATA},
        )
    bad = [dict(s) for s in DATA]
    bad[5]["input_ids"] = bad[5]["input_ids"][:-3]
    with pytest.raises(ValueError, match="sample 5"):
        make(val=bad)
    trainer = make(val=DATA[:6])  # 2 of 6 do not fill a global batch: a warning
    assert trainer.val_plan.steps_per_epoch == 1


def test_packing_length_is_checked_on_the_driver():
    longest = max(len(s["input_ids"]) for s in DATA)
    with pytest.raises(ValueError, match="more than train_loop_config\\['max_seq_len'\\]"):
        make(loop={"pack_sequences": True, "max_seq_len": longest - 1})
    assert make(loop={"pack_sequences": True, "max_seq_len": longest}).loop_config.pack_sequences


def test_min_lr_ratio_needs_a_decaying_schedule():
    with pytest.raises(ValueError, match="applies to the 'linear' and 'cosine'"):
        TrainLoopConfig(**dict(LOOP, min_lr_ratio=0.1))


def test_frozen_weights_stay_frozen_when_a_tp_plan_splits_them():
    qkv = torch.nn.Linear(8, 24)
    qkv.requires_grad_(False)
    split = SplitQKV(qkv)
    assert not any(p.requires_grad for p in split.parameters())
    assert all(p.requires_grad for p in SplitQKV(torch.nn.Linear(8, 24)).parameters())


def test_a_group_with_nothing_to_train_issues_no_collective():
    all_reduce_gradients([], group=None)  # no process group exists here: would raise


def test_evaluation_steps_are_reported():
    cfg = TrainLoopConfig(**dict(LOOP, max_steps=9, report_every=5, eval_every=3))
    args = LoopArgs(spec=None, cfg=cfg, groups={}, plan=None, val_plan=object())
    reported = [s + 1 for s in range(9) if is_reported_step(args, s)]
    assert reported == [3, 5, 6, 9]
    no_val = LoopArgs(spec=None, cfg=cfg, groups={}, plan=None)
    assert [s + 1 for s in range(9) if is_reported_step(no_val, s)] == [5, 9]
