"""Tier 1: LoRA settings refused on the driver by :func:`ray_disagg.config.layout.resolve`
(``ValueError`` naming the setting and the fix), on ``meta`` models, and the name map
between a part under LoRA and PEFT's adapter file."""

import json

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model

from ray_disagg import (
    ADAPTERS,
    ContextParallel,
    DataParallel,
    ExpertParallel,
    HFModelSpec,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl_moe_config,
)
from ray_disagg.config.layout import DataSpec, resolve
from ray_disagg.lora.layers import check_lora_config, file_key, fresh_factor, inject, is_factor
from tests.helpers import group, vt

LOOP = {"max_steps": 2, "global_batch_size": 2}
SPEC = HFModelSpec(config=tiny_qwen2_5_vl_config())


def lora_group(n=1, parallelism="none", **kw) -> ModuleGroup:
    g = group(n, parallelism)
    return ModuleGroup(
        scaling_config=g.scaling_config,
        parallelism=g.parallelism,
        peft_config=LoraConfig(**({"r": 4, "target_modules": ["q_proj", "v_proj"]} | kw)),
    )


def check(groups, spec=SPEC):
    return resolve(spec, groups, LOOP, data=DataSpec(kind="map"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A pretrained directory and a PEFT adapter saved from it (LLM only)."""
    base, adapter = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("adapter")
    model = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=1).build_full()
    model.save_pretrained(base)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(adapter)
    return base, adapter


def test_a_lora_group_is_accepted_and_only_its_part_is_under_lora():
    layout = check(vt(group(1), lora_group(2, DataParallel(fsdp=True))))
    assert layout.lora_parts == {"text"} and layout.frozen_parts == ()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ModuleGroup(scaling_config=group(1).scaling_config, peft_config=IA3Config(
            target_modules=["q_proj"], feedforward_modules=[])), "only LoRA"),
        (lambda: lora_group(bias="all"), "bias='none'"),
        (lambda: lora_group(use_dora=True), "DoRA"),
        (lambda: lora_group(init_lora_weights="pissa"), "rewrite the base"),
        (lambda: lora_group(target_modules=None), "target_modules is not set"),
        (lambda: ModuleGroup(scaling_config=group(1).scaling_config, trainable=False,
                             peft_config=LoraConfig(target_modules=["q_proj"])), "trainable=False"),
    ],
)  # fmt: skip
def test_bad_lora_configs_are_refused_when_the_group_is_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_targets_matching_nothing_in_the_groups_part_name_its_modules():
    with pytest.raises(ValueError, match=r"matches no module of the vision part.*qkv"):
        check(vt(lora_group(1), group(1)))


def test_lora_under_tp_sp_cp_is_accepted_and_expert_parallel_refused():
    layout = check(
        vt(
            lora_group(2, SequenceParallel(size=2), target_modules=["qkv"]),
            lora_group(4, TensorParallel(size=2, fsdp=True)),
        )
    )
    assert layout.lora_parts == {"vision", "text"}
    check(vt(group(1), lora_group(2, ContextParallel(size=2))))
    moe = HFModelSpec(config=tiny_qwen3_vl_moe_config())
    with pytest.raises(ValueError, match="ExpertParallel is not supported yet"):
        check(vt(group(1), lora_group(2, ExpertParallel(size=2))), moe)


def test_adapter_directories_are_checked(saved, tmp_path):
    base, adapter = saved
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    with pytest.raises(ValueError, match=r"the vision part has nothing to train.*trainable=False"):
        check(vt(group(1), group(1)), spec)
    frozen_vision = ModuleGroup(scaling_config=group(1).scaling_config, trainable=False)
    layout = check(vt(frozen_vision, group(1)), spec)
    assert layout.lora_parts == {"vision", "text"} and layout.frozen_parts == ("vision",)
    with pytest.raises(ValueError, match="both put an adapter on the text part"):
        check(vt(frozen_vision, lora_group(1)), spec)
    (tmp_path / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        HFModelSpec(pretrained_path=base, peft_path=tmp_path)
    other = tmp_path / "other"  # saved from a wider model: the shapes do not fit
    wide = HFModelSpec(config=tiny_qwen2_5_vl_config(text_hidden=32))
    get_peft_model(wide.build_full(), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        other
    )
    with pytest.raises(ValueError, match="saved from another model"):
        check(vt(frozen_vision, group(1)), HFModelSpec(pretrained_path=base, peft_path=other))


def test_a_quantized_base_is_refused(saved, tmp_path):
    base, adapter = saved
    cfg = json.loads((base / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"bits": 4}}))
    for f in base.glob("*.safetensors"):
        (tmp_path / f.name).symlink_to(f)
    spec = HFModelSpec(pretrained_path=tmp_path)
    with pytest.raises(ValueError, match="QLoRA"):
        check(
            vt(group(1), lora_group(1)),
            spec,
        )


def test_part_names_map_to_peft_file_keys():
    model = SPEC.meta_model("text")
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    config.layers_to_transform = [0]  # PEFT's own option: only the first layer
    assert inject(model, config) == ["model.language_model.layers.0.self_attn.q_proj"]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {
        "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "model.language_model.layers.0.self_attn.q_proj.lora_B.default.weight",
        "lm_head.weight",
    }
    assert {file_key(n) for n in trained if is_factor(n)} == {
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight",
    }
    assert all(p.device == torch.device("meta") for p in model.parameters())


def test_what_peft_would_do_differently_is_refused():
    with pytest.raises(ValueError, match="'merger' matches no module of the text part"):
        check(vt(group(1), lora_group(1, modules_to_save=["merger"])))
    with pytest.raises(ValueError, match=r"embed_tokens \(a Embedding\) is not supported"):
        check(vt(group(1), lora_group(1, target_modules=["q_proj", "embed_tokens"])))
    tied = HFModelSpec(config=ADAPTERS["internvl"].tiny_config())
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\] holds a tied"):
        check(vt(group(1), lora_group(1, modules_to_save=["lm_head"])), tied)
    frozen_factors = lora_group(1)
    frozen_factors.freeze = ("model.language_model",)
    with pytest.raises(ValueError, match="the text part has nothing to train"):
        check(vt(group(1), frozen_factors))
    with pytest.raises(ValueError, match="pair with a rewritten base"):
        check_lora_config(LoraConfig(target_modules=["q"], init_lora_weights="pissa"), "x", True)


def test_fresh_factors_follow_peft_init_lora_weights():
    a, b = "m.q_proj.lora_A.default.weight", "m.q_proj.lora_B.default.weight"
    default = LoraConfig(r=8, target_modules=["q_proj"])
    assert fresh_factor(b, (64, 8), default, 0).abs().max() == 0  # B zero: starts at the base
    a0 = fresh_factor(a, (8, 64), default, 0)
    assert 0 < a0.abs().max() <= 1 / 64**0.5  # nn.Linear's Kaiming uniform bound
    assert torch.equal(a0, fresh_factor(a, (8, 64), default, 0))  # a function of (seed, name)
    assert not torch.equal(a0, fresh_factor(a, (8, 64), default, 1))
    gauss = fresh_factor(a, (8, 4096), LoraConfig(r=8, init_lora_weights="gaussian"), 0)
    assert abs(float(gauss.std()) - 1 / 8) < 0.01
    assert fresh_factor(b, (64, 8), LoraConfig(init_lora_weights=False), 0).abs().max() > 0
