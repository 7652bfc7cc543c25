"""Tier 2 (``testing.local``): DPO with LoRA equals single-process Hugging Face + PEFT
DPO (AdamW, fp32, 3 steps): a fresh adapter on the LLM under FSDP2 with a frozen tower,
the reference being the model with its adapters disabled (no copy: PEFT's
``disable_adapter()``); and a saved adapter with nonzero ``lora_B`` and a merger trained
through ``modules_to_save`` under vision SP2 + text TP2, where the reference must be a
frozen copy of the initial adapter (``reference="auto"`` picks it)."""

import dataclasses

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from ray_disagg import (
    DPO,
    DataParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_pairs
from ray_disagg.lora.layers import fresh_factor, is_factor
from ray_disagg.testing.reference import reference_preference
from tests.helpers import assert_params_close, checkpoint_state, group, losses, run_layout, vt
from tests.lora_data import GRIDS, save_base_and_adapter
from tests.preference_data import trl_pair_loss

LOOP = {"global_batch_size": 4, "max_steps": 3, "eps": 1e-6, "seed": 3}
FRESH = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])  # the LLM
PEFT_PREFIX = "base_model.model."


def trained_adapter(result) -> dict[str, torch.Tensor]:
    return {k: v for k, v in checkpoint_state(result.checkpoint).items() if is_factor(k)}


def peft_factors(model) -> dict[str, torch.Tensor]:
    return {
        k.removeprefix(PEFT_PREFIX): p.detach() for k, p in model.named_parameters() if is_factor(k)
    }


def test_fresh_lora_with_adapters_disabled_equals_peft(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    spec, pairs = HFModelSpec(config=cfg, seed=4), synthetic_pairs(cfg, 8, grids=GRIDS)
    peft_model = get_peft_model(spec.build_full(), FRESH)
    with torch.no_grad():  # the run's fresh factors: a function of (seed, name)
        for name, p in peft_model.named_parameters():
            if is_factor(name):
                p.copy_(fresh_factor(name.removeprefix(PEFT_PREFIX), p.shape, FRESH, spec.seed))
    pair_loss = trl_pair_loss("sigmoid", 0.1)
    ref_losses, ref_logps, ref = reference_preference(
        spec, pairs, TrainLoopConfig(**LOOP), pair_loss, peft_model=peft_model
    )
    vision = dataclasses.replace(group(1), trainable=False)
    text = dataclasses.replace(group(2, DataParallel(fsdp=True)), peft_config=FRESH)
    dpo = DPO(beta=0.1, reference="adapters_disabled")
    loop = LOOP | {"objective": dpo, "micro_batches": 2}
    result = run_layout(spec, pairs, loop, vt(vision, text), tmp_path, "fresh", local=True)

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(trained_adapter(result), peft_factors(ref), 1e-5)
    frame = load_metrics(result)
    chosen = [float(0.1 * (p[:, 0] - r[:, 0]).mean()) for p, r in ref_logps]
    torch.testing.assert_close(frame["rewards/chosen"].tolist(), chosen, atol=1e-6, rtol=0.0)


def test_saved_adapter_with_saved_modules_uses_a_copy_and_equals_peft(tmp_path):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    pairs = synthetic_pairs(tiny_qwen2_5_vl_config(), 8, grids=GRIDS)
    save_base_and_adapter(base, adapter)
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    peft_model = PeftModel.from_pretrained(spec.build_full(), adapter, is_trainable=True)
    pair_loss = trl_pair_loss("ipo", 0.5)
    ref_losses, _, ref = reference_preference(
        spec, pairs, TrainLoopConfig(**LOOP), pair_loss, peft_model=peft_model,
        peft_reference="copy",
    )  # fmt: skip
    groups = vt(group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2)))
    loop = LOOP | {"objective": DPO(beta=0.5, loss_type="ipo")}  # auto: a copy
    result = run_layout(spec, pairs, loop, groups, tmp_path, "saved", local=True)

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(trained_adapter(result), peft_factors(ref), 1e-5)
