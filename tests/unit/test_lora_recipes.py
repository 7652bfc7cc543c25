"""Tier 1: LoRA in recipes (``groups.<part>.lora``, ``model.peft_path``) and in the
planner: the bundled Qwen2.5-VL-32B LoRA recipe is accepted by ``ray-disagg plan``, whose
estimate counts the base's parameters alone plus 16 B per LoRA parameter (fp32 factors,
gradients and AdamW state), and ``plan --auto``'s cost model bills a LoRA part's backward
as input gradients only."""

import pytest
from peft import LoraConfig

from ray_disagg.lora.layers import is_factor
from ray_disagg.planner import cost
from ray_disagg.planner.memory import estimate, part_model
from ray_disagg.recipes.cli import plan
from ray_disagg.recipes.recipe import load_recipe
from ray_disagg.recipes.schema import RecipeError

LORA_RECIPE = "qwen2_5_vl_32b_lora_8gpu"


def small(lora=None, **text):
    group = {"num_workers": 2, "parallelism": {"type": "tensor", "size": 2}, **text}
    if lora is not None:
        group["lora"] = lora
    return load_recipe({
        "model": {"config": "tiny_qwen2_5_vl"},
        "data": {"train": {"type": "digits", "num_samples": 8, "image_size": 16}},
        "groups": {"vision": {"num_workers": 1}, "text": group},
        "train_loop_config": {"max_steps": 2, "global_batch_size": 2},
        "plan": {"image_size": [32, 32], "images_per_sample": 1},
    })  # fmt: skip


def test_recipe_lora_keys_become_peft_configs():
    r = small({"r": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"], "dropout": 0.1})
    c = r.groups["text"].peft_config
    assert isinstance(c, LoraConfig) and (c.r, c.lora_alpha, c.lora_dropout) == (4, 8, 0.1)
    assert c.target_modules == {"q_proj", "o_proj"} and r.groups["vision"].peft_config is None
    with pytest.raises(RecipeError, match=r"groups.text.lora: unknown key\(s\) \['rank'\]"):
        small({"rank": 4, "target_modules": ["q_proj"]})
    with pytest.raises(RecipeError, match="groups.text.lora.target_modules: name the modules"):
        small({"r": 4})


def test_the_estimate_counts_the_base_plus_16_bytes_per_lora_parameter():
    full = estimate(small())["text"]
    r = small({"r": 4, "target_modules": ["q_proj", "o_proj"]})
    lora = estimate(r)["text"]
    local = {n: p.numel() for n, p in part_model(r, "text").named_parameters()}
    # TP2: q_proj's lora_B and o_proj's lora_A are split, the other factor whole
    split = [n for n in local if (".q_proj.lora_B" in n or ".o_proj.lora_A" in n)]
    factors = sum(v / (2 if n in split else 1) for n, v in local.items() if is_factor(n))
    assert factors > 0
    base = full.params / 4
    assert lora.params == pytest.approx(4 * base + 4 * factors)
    assert lora.grads + lora.optimizer == pytest.approx(12 * factors)
    facts = cost.model_facts(r)
    assert facts.parts["text"].lora and cost.passes(r, "text", facts) == 2
    assert cost.passes(small(), "text", cost.model_facts(small())) == 3


def test_the_bundled_lora_recipe_plans():
    text = plan(LORA_RECIPE)
    assert "LoRA r=16 alpha=32" in text and "per GPU" in text
    r = load_recipe(LORA_RECIPE)
    lora, vision = estimate(r)["text"], estimate(r)["vision"]
    assert lora.grads < 0.05 * lora.params  # only the factors have gradients
    assert vision.grads > 0  # the merger trains in full
