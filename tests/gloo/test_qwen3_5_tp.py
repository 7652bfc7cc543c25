"""Tier 2 (the groups' workers without Ray, ``testing.local``): Qwen3.5's text tensor
parallelism (Gated DeltaNet sharded by key heads, its fused ``in_proj_qkv`` and ``conv1d``
stored as unequal q/k/v row blocks) with what else touches those blocks:

- LoRA: a saved PEFT adapter on ``in_proj_qkv`` (its ``lora_B`` split with it), the
  column-wise ``in_proj_z``, the row-wise ``out_proj`` and the gated attention's
  ``q_proj``, trained with text TP2 from a pretrained directory (each rank reads its
  rows of the fused tensors), equals Hugging Face + PEFT (``PeftModel.from_pretrained(...,
  is_trainable=True)``, AdamW, fp32, 3 steps): the losses and the trained adapter under
  PEFT's file keys; the same under text CP2 (the layers' head slices of the factors);
- resuming across layouts: a TP2 checkpoint (row blocks) resumed under FSDP2 and an FSDP2
  checkpoint (fused tensors) resumed under TP2 continue the uninterrupted run.
"""

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from ray_disagg import (
    ContextParallel,
    DataParallel,
    HFModelSpec,
    TensorParallel,
    TrainLoopConfig,
    tiny_qwen3_5_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.lora.layers import file_key, is_factor
from ray_disagg.testing.reference import reference_train_peft
from tests.helpers import checkpoint_state, group, losses, run_layout, vt

LOOP = {"global_batch_size": 4, "max_steps": 3, "eps": 1e-6, "seed": 3}
LORA = LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=["in_proj_qkv", "in_proj_z", "out_proj", "q_proj"],
    init_lora_weights=False,  # lora_B nonzero: a sharding bug in A cannot hide
)


@pytest.mark.parametrize("text", ["tp2", "cp2"])
def test_lora_on_gated_deltanet_under_text_tp_or_cp_equals_hf_peft(tmp_path, text):
    """Under CP the Gated DeltaNet's head slices take the factors on the sliced side
    (``lora_B`` of the input projections, ``lora_A`` of ``out_proj``)."""
    cfg = tiny_qwen3_5_config()
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    model = HFModelSpec(config=cfg, seed=11).build_full()
    model.save_pretrained(base)
    torch.manual_seed(0)
    get_peft_model(model, LORA).save_pretrained(adapter)
    data = synthetic_samples(cfg, 8, grids=[(1, 4, 4), None, (1, 4, 8), (1, 8, 4)])
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    ref_losses, ref = reference_train_peft(spec, adapter, data, TrainLoopConfig(**LOOP))

    frozen = dataclasses.replace(group(1), trainable=False)  # the adapter is the LLM's
    layout = TensorParallel(size=2) if text == "tp2" else ContextParallel(size=2)
    groups = vt(frozen, group(2, layout))
    result = run_layout(spec, data, LOOP, groups, tmp_path, text, local=True)
    torch.testing.assert_close(
        torch.tensor(losses(result)), torch.tensor(ref_losses), rtol=1e-5, atol=0.0
    )
    state = checkpoint_state(result.checkpoint)
    trained = get_peft_model_state_dict(ref)
    ours = {file_key(k): v for k, v in state.items() if is_factor(k)}
    assert set(ours) == set(trained)
    assert any("in_proj_qkv.lora_B" in k for k in trained)
    for key, value in trained.items():
        torch.testing.assert_close(ours[key], value, rtol=0.0, atol=1e-5, msg=key)


def test_checkpoints_move_between_row_blocks_and_fused_tensors(tmp_path):
    cfg = tiny_qwen3_5_config()
    spec, data = HFModelSpec(config=cfg, seed=7), synthetic_samples(cfg, 12)
    tp = vt(group(1), group(2, TensorParallel(size=2)))
    fsdp = vt(group(1), group(2, DataParallel(fsdp=True)))

    def fit(groups, steps, name, resume=None):
        loop = LOOP | {"max_steps": steps}
        return run_layout(spec, data, loop, groups, tmp_path, name, local=True, resume=resume)

    straight = fit(fsdp, 3, "straight").metrics["loss"]
    for first, then in ((tp, fsdp), (fsdp, tp)):
        name = "tp-fsdp" if first is tp else "fsdp-tp"
        moved = fit(then, 3, name, fit(first, 2, f"{name}-first").checkpoint)
        assert moved.metrics["loss"] == pytest.approx(straight, rel=1e-5), name


def test_pure_bf16_text_tp_keeps_the_split_blocks_in_bf16(tmp_path):
    """``param_dtype="bfloat16"`` casts the model before the plan splits ``in_proj_qkv``
    and ``conv1d``: the blocks stay bf16 (a float32 block would fail the bf16 input), and
    the run follows the fp32 model's losses within bf16's precision."""
    cfg = tiny_qwen3_5_config()
    spec = HFModelSpec(config=cfg, seed=5)
    data = synthetic_samples(cfg, 8, grids=[(1, 4, 4), None, (1, 4, 8), (1, 8, 4)])
    loop = dict(LOOP, param_dtype="bfloat16", bf16=True, lr=1e-3)
    groups = vt(group(1), group(2, TensorParallel(size=2)))
    result = run_layout(spec, data, loop, groups, tmp_path, "bf16", local=True)
    state = checkpoint_state(result.checkpoint)
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    ref = run_layout(spec, data, dict(LOOP, lr=1e-3), vt(group(1), group(1)), tmp_path, "fp32",
                     local=True)  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(losses(result)), torch.tensor(losses(ref)), rtol=0.02, atol=0.0
    )
