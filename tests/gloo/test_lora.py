"""Tier 2 (the groups' workers without Ray, ``testing.local``): LoRA from a saved PEFT
adapter directory (nonzero ``lora_B``, LoRA on both parts, the merger trained in full
through ``modules_to_save``) equals an independent single-process Hugging Face + PEFT run
(``PeftModel.from_pretrained(..., is_trainable=True)``, AdamW, fp32, 3 steps): the
losses, the trained adapter under PEFT's file keys, the merged weights, and base weights
that never move."""

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from ray_disagg import DataParallel, HFModelSpec, TrainLoopConfig, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models.lora import base_name, file_key, is_factor
from ray_disagg.testing.reference import reference_train_peft
from tests.helpers import checkpoint_state, group, run_layout, vt

GRIDS = [(1, 4, 4), None, (1, 4, 8), (1, 8, 4)]
LOOP = {"global_batch_size": 4, "max_steps": 3, "checkpoint_every": 1, "eps": 1e-6, "seed": 3}
LORA = LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=["qkv", "q_proj", "v_proj", "gate_proj"],  # tower and LLM
    modules_to_save=["merger"],
    init_lora_weights=False,  # lora_B nonzero: a sharding bug in A cannot hide
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A pretrained directory and a PEFT adapter directory saved from it."""
    cfg = tiny_qwen2_5_vl_config()
    base, adapter = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("adapter")
    model = HFModelSpec(config=cfg, seed=11).build_full()
    model.save_pretrained(base)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LORA)
    with torch.no_grad():  # the saved merger differs from the base's
        for p in peft_model.base_model.model.model.visual.merger.modules_to_save.parameters():
            p.add_(0.01 * torch.randn_like(p))
    peft_model.save_pretrained(adapter)
    return base, adapter, synthetic_samples(cfg, 8, grids=GRIDS)


def merged(state: dict, scale: float) -> dict:
    """``W + scale * B @ A`` of every adapted module; the other base weights as they are."""
    out = {base_name(k): v for k, v in state.items() if not is_factor(k)}
    for k, a in state.items():
        if ".lora_A." in k:
            module = k.split(".lora_A.")[0]
            b = state[k.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = out[f"{module}.weight"] + scale * b @ a
    return out


@pytest.fixture(scope="module")
def reference(saved):
    base, adapter, data = saved
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    return reference_train_peft(spec, adapter, data, TrainLoopConfig(**LOOP))


LAYOUTS = {
    "vision1-text-fsdp2": (lambda: vt(group(1), group(2, DataParallel(fsdp=True))), {}),
    "vision-zero1-dp2-text1-1f1b": (
        lambda: vt(group(2, DataParallel(zero1=True)), group(1)),
        {"micro_batches": 2},
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layouts_equal_hf_peft(saved, reference, tmp_path, layout):
    base, adapter, data = saved
    ref_losses, ref = reference
    groups, loop = LAYOUTS[layout]
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    result = run_layout(spec, data, LOOP | loop, groups(), tmp_path, layout, local=True)

    got = result.metrics_dataframe.sort_values("step")
    torch.testing.assert_close(
        torch.tensor(got["loss"].tolist()), torch.tensor(ref_losses), rtol=1e-5, atol=0.0
    )
    state = checkpoint_state(result.checkpoint)
    trained = get_peft_model_state_dict(ref)  # PEFT's file keys
    ours = {file_key(k): v for k, v in state.items() if is_factor(k) or ".merger." in k}
    assert set(ours) == set(trained)
    for key, value in trained.items():
        torch.testing.assert_close(ours[key], value, rtol=0.0, atol=1e-5, msg=key)
    start = load_file(adapter / "adapter_model.safetensors")
    moved = [k for k in trained if (trained[k] - start[k]).abs().max() > 1e-4]
    assert len(moved) == len(trained)  # every factor and merger tensor trained

    ref_merged = merged_reference(ref)
    ours_merged = merged(state, LORA.lora_alpha / LORA.r)
    assert set(ours_merged) == set(ref_merged)
    for key, value in ref_merged.items():
        torch.testing.assert_close(ours_merged[key], value, rtol=0.0, atol=1e-5, msg=key)
    start = HFModelSpec(pretrained_path=base).build_full().state_dict()
    frozen = [k for k in state if ".base_layer." in k or "layernorm" in k]
    assert frozen and all(torch.equal(state[k], start[base_name(k)]) for k in frozen)


def merged_reference(ref) -> dict:
    """PEFT's own merge (``merge_and_unload``) of a copy: the reference stays a PeftModel
    for the next layout."""
    import copy

    return copy.deepcopy(ref).merge_and_unload().state_dict()


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", torch.float32), ("pure", torch.bfloat16)])
def test_lora_factor_dtypes_under_fsdp2_bf16(saved, reference, tmp_path, mode, dtype):
    """``bf16=True``: fp32 factors (bf16 compute, as the base); ``param_dtype="bfloat16"``:
    bf16 factors. Both in one FSDP2 unit with the frozen base, close to the fp32 losses."""
    base, adapter, data = saved
    loop = LOOP | {"max_steps": 2, "bf16": True}
    if mode == "pure":
        loop["param_dtype"] = "bfloat16"
    groups = vt(group(1), group(2, DataParallel(fsdp=True)))
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    result = run_layout(spec, data, loop, groups, tmp_path, mode, local=True)
    state = checkpoint_state(result.checkpoint)
    assert {v.dtype for k, v in state.items() if is_factor(k)} == {dtype}
    losses = result.metrics_dataframe.sort_values("step")["loss"].tolist()
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference[0][:2]), rtol=0.02, atol=0.0
    )
