"""Tier 1: bad settings, samples and checkpoints fail on the driver, naming the fix."""

import json
import math

import numpy as np
import pytest
from ray.train import Checkpoint, ScalingConfig

from ray_disagg import (
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    SampleError,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models import get_adapter
from ray_disagg.worker.shards import check_compatible

CFG = tiny_qwen2_5_vl_config()
LOOP = {"max_steps": 4, "global_batch_size": 4}


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("lr", math.nan, "'lr'.*finite float > 0"),
        ("lr", 0.0, "'lr'.*finite float > 0"),
        ("betas", (1.5, 0.9), r"'betas'.*\[0, 1\)"),
        ("betas", (0.9,), r"'betas'.*two floats"),
        ("weight_decay", -1, "'weight_decay'.*>= 0"),
        ("eps", math.inf, "'eps'"),
        ("max_grad_norm", math.nan, "'max_grad_norm'"),
        ("collective_timeout_s", 0, "'collective_timeout_s'.*seconds > 0"),
    ],
)
def test_optimizer_and_timeout_settings_are_validated(key, value, match):
    with pytest.raises(ValueError, match=match):
        TrainLoopConfig(**LOOP, **{key: value})


def test_collective_timeout_keeps_fractions():
    assert TrainLoopConfig(**LOOP, collective_timeout_s=0.5).collective_timeout_s == 0.5


def test_token_ids_and_labels_outside_the_vocabulary_name_the_sample():
    adapter = get_adapter(CFG)
    (s,) = synthetic_samples(CFG, 1)
    ids = s["input_ids"].copy()
    ids[-1] = CFG.text_config.vocab_size
    with pytest.raises(SampleError, match=r"'oov'.*input_ids \[128\] are outside.*\[0, 128\)"):
        adapter.validate_sample(dict(s, id="oov", input_ids=ids))
    labels = s["labels"].copy()
    labels[-1] = -5
    with pytest.raises(SampleError, match=r"'lab'.*labels \[-5\].*-100"):
        adapter.validate_sample(dict(s, id="lab", labels=labels))


def _checkpoint_dir(tmp_path, config, step: int):
    root = tmp_path / "ckpt"
    (root / "text").mkdir(parents=True)
    config.save_pretrained(root)
    (root / "text" / "trainer_state.json").write_text(json.dumps({"step": step}))
    return root


def test_resume_from_another_model_names_the_differing_fields(tmp_path):
    root = _checkpoint_dir(tmp_path, tiny_qwen2_5_vl_config(text_layers=2), 2)
    with pytest.raises(ValueError, match=r"text_config.num_hidden_layers: checkpoint 2 vs run 1"):
        check_compatible(str(root), tiny_qwen2_5_vl_config(text_layers=1), 10)
    with pytest.raises(ValueError, match=r"hidden_size: checkpoint 64 vs run 32"):
        check_compatible(str(root), tiny_qwen2_5_vl_config(text_hidden=32), 10)
    assert check_compatible(str(root), tiny_qwen2_5_vl_config(text_layers=2), 10) == 2


def test_resume_at_or_past_max_steps_says_so_on_the_driver(tmp_path):
    root = _checkpoint_dir(tmp_path, CFG, 4)
    data = synthetic_samples(CFG, 8)
    with pytest.raises(ValueError, match="already at step 4 and max_steps=4"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={
                "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
                "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
            },
            train_loop_config=LOOP,
            datasets={"train": data},
            resume_from_checkpoint=Checkpoint.from_directory(str(root)),
        )


def test_wrong_patch_dimension_names_the_sample():
    (s,) = synthetic_samples(CFG, 1)
    bad = dict(s, id="px", pixel_values=np.zeros((16, 7), np.float32))
    with pytest.raises(SampleError, match=r"'px'.*needs \(16, 96\)"):
        get_adapter(CFG).validate_sample(bad)
