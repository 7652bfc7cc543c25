"""Shared data of the LoRA tests: a pretrained tiny Qwen2.5-VL directory and a PEFT adapter
directory saved from it (nonzero ``lora_B``, LoRA on the tower's fused ``qkv`` and the
LLM, the merger trained in full through ``modules_to_save``), and the comparison of a
trained run with the Hugging Face + PEFT reference."""

import copy

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.lora.layers import base_name, file_key, is_factor
from tests.helpers import checkpoint_state, losses

GRIDS = [(1, 4, 4), None, (1, 4, 8), (1, 8, 4)]
LORA = LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=["qkv", "q_proj", "v_proj", "gate_proj"],  # tower and LLM
    modules_to_save=["merger"],
    init_lora_weights=False,  # lora_B nonzero: a sharding bug in A cannot hide
)


def save_base_and_adapter(base, adapter, samples: int = 8):
    """Write the pretrained directory ``base`` and the adapter directory ``adapter``;
    returns the samples."""
    cfg = tiny_qwen2_5_vl_config(vocab_size=135)  # TP2 splits it unevenly (68 + 67 rows)
    model = HFModelSpec(config=cfg, seed=11).build_full()
    model.save_pretrained(base)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LORA)
    with torch.no_grad():  # the saved merger differs from the base's
        for p in peft_model.base_model.model.model.visual.merger.modules_to_save.parameters():
            p.add_(0.01 * torch.randn_like(p))
    peft_model.save_pretrained(adapter)
    return synthetic_samples(cfg, samples, grids=GRIDS)


def merged(state: dict, base: dict, scale: float) -> dict:
    """``W + scale * B @ A`` of every adapted module, from a LoRA checkpoint's ``state``
    (factors and saved modules) over the ``base`` weights."""
    out = {**base, **{base_name(k): v for k, v in state.items() if not is_factor(k)}}
    for k, a in state.items():
        if ".lora_A." in k:
            module = k.split(".lora_A.")[0]
            b = state[k.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = out[f"{module}.weight"] + scale * b @ a
    return out


def assert_matches_peft(result, ref_losses, ref, base, adapter, atol: float = 1e-5) -> None:
    """Losses (relative 1e-5), the trained adapter under PEFT's file keys and the merged
    weights (``atol``) equal the reference ``ref`` (a trained ``PeftModel``); every factor
    and merger tensor moved; the checkpoint holds no base weight."""
    got = losses(result)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-5, atol=0.0)
    state = checkpoint_state(result.checkpoint)
    trained = get_peft_model_state_dict(ref)  # PEFT's file keys
    ours = {file_key(k): v for k, v in state.items() if is_factor(k) or ".merger." in k}
    assert set(ours) == set(trained)
    for key, value in trained.items():
        torch.testing.assert_close(ours[key], value, rtol=0.0, atol=atol, msg=key)
    start = load_file(adapter / "adapter_model.safetensors")
    assert all((trained[k] - start[k]).abs().max() > 1e-4 for k in trained)

    ref_merged = copy.deepcopy(ref).merge_and_unload().state_dict()  # ref stays a PeftModel
    assert not any(".base_layer." in k or "layernorm" in k for k in state)  # base not saved
    initial = HFModelSpec(pretrained_path=base).build_full().state_dict()
    ours_merged = merged(state, initial, LORA.lora_alpha / LORA.r)
    assert set(ours_merged) == set(ref_merged)
    for key, value in ref_merged.items():
        torch.testing.assert_close(ours_merged[key], value, rtol=0.0, atol=atol, msg=key)
