"""Tier 2 (the groups' workers without Ray, ``testing.local``): GRPO on recorded rollouts
(completions and rewards fixed) equals an independently written single-process GRPO
with TRL's formulas on the HF model (``tests.grpo_reference``: per-token log-probs from
full logits, advantages from the global batch's rewards, the old log-probs a forward
before a batch's first update, AdamW, fp32, 3 steps, 4 with two per batch): losses and
parameters within 1e-5 relative (losses near 0, as a first step's is, within 1e-7),
TRL's metrics within 1e-6, in layouts that cover FSDP2 with 1F1B microbatches and a KL
to a copy, a sequence-level ratio (GSPO) summed over context-parallel slices of packed
rows with 1F1B microbatches, the first iteration's log-probs kept for the second, and
LoRA whose reference is the model without its adapters. The label-position path under
TP (vocab-parallel, DAPO) and a frozen tower whose rows serve every completion (BNPO,
masked truncated completions) are checked on generated rollouts, whose updates the same
reference computes (``tests/gloo/test_grpo_rollouts.py``)."""

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from ray_disagg import (
    GRPO,
    ContextParallel,
    DataParallel,
    HFModelSpec,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_rollouts
from ray_disagg.lora.layers import fresh_factor, is_factor
from tests.grpo_reference import reference_grpo
from tests.helpers import (
    assert_params_close,
    built_trainer,
    checkpoint_state,
    group,
    losses,
    run_layout,
    vt,
)

G, MAX_LEN = 4, 6
ATOL = 1e-7  # a loss is a sum of terms that cancel (advantages are centred): ~1e-9 at first
LOOP = {"global_batch_size": 4, "max_steps": 3, "eps": 1e-6, "seed": 3}
GRIDS = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8)]
PEFT_PREFIX = "base_model.model."


def exact(prompts, completions, **kwargs):
    """A reward function as TRL calls it (the rollouts here carry recorded rewards)."""
    return [1.0 for _ in completions]


def short(prompts, completions, completion_ids, **kwargs):
    return [float(len(c) < 4) for c in completion_ids]


def frozen(n: int):
    return dataclasses.replace(group(n), trainable=False)


CASES = {
    "text-fsdp2-1f1b-grpo-kl-copy": (
        lambda: vt(group(1), group(2, DataParallel(fsdp=True))),
        {"micro_batches": 2},
        {"loss_type": "grpo", "beta": 0.04, "reference": "copy", "scale_rewards": "batch"},
    ),
    "text-cp2-packed-gspo-2-iterations": (
        lambda: vt(group(1), group(2, ContextParallel(size=2))),
        {
            "pack_sequences": True,
            "max_seq_len": 64,
            "loss_chunk_tokens": 5,
            "lr": 5e-3,
            "micro_batches": 2,
            "max_steps": 4,
        },  # fmt: skip
        {
            "importance_sampling_level": "sequence",
            "num_iterations": 2,
            "epsilon": 0.02,
            "loss_type": "grpo",
            "beta": 0.04,
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    rollouts = synthetic_rollouts(cfg, 8, G, max_completion_length=MAX_LEN, grids=GRIDS)
    return HFModelSpec(config=cfg, seed=4), rollouts


def grpo(**opts) -> GRPO:
    return GRPO(reward_funcs=[exact, short], num_generations=G, max_completion_length=MAX_LEN,
                **opts)  # fmt: skip


def assert_metrics(result, want: list[dict], names) -> None:
    frame = load_metrics(result)
    assert set(names) <= set(frame.columns)  # TRL's names
    for name in names:
        expected = [step[name] for step in want]
        torch.testing.assert_close(frame[name].tolist(), expected, atol=1e-6, rtol=0.0, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_layouts_equal_single_process_trl(setup, tmp_path, case):
    spec, rollouts = setup
    groups, loop, opts = CASES[case]
    obj = grpo(**opts)
    run = LOOP | loop | {"objective": obj}
    plan = built_trainer(spec, rollouts, run, groups(), tmp_path).plan
    names = {"names": obj.reward_names, "num_generations": G, "max_completion_length": MAX_LEN}
    ref_losses, ref_metrics, ref_model = reference_grpo(
        spec, rollouts, TrainLoopConfig(**LOOP | loop), opts | names, plan, groups=groups()
    )
    result = run_layout(spec, rollouts, run, groups(), tmp_path, case, local=True)

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=ATOL)
    assert max(abs(v) for v in ref_losses) > 100 * ATOL  # the tolerance is not the test
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), 1e-5)
    assert_metrics(result, ref_metrics, [*obj.metric_names, *obj.step_metric_names])
    frame = load_metrics(result)
    steps = range(run["max_steps"])
    images = [sum(int(rollouts[i].get("image_grid_thw") is not None)
                  for i in plan.global_indices(s)) for s in steps]  # fmt: skip
    assert frame["images"].tolist() == images  # each prompt's image encoded once per step
    if obj.num_iterations > 1:  # the second step reuses the first's batch, clipped
        assert plan.global_indices(0) == plan.global_indices(1)
        assert frame["clip_ratio/region_mean"].iloc[1] > 0


def test_lora_with_adapters_disabled_equals_peft(setup, tmp_path):
    """A fresh LoRA adapter on the LLM, the KL's reference being the model with its
    adapters disabled (PEFT's ``disable_adapter()``; no copy), ``dr_grpo``."""
    spec, rollouts = setup
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(spec.build_full(), lora)
    with torch.no_grad():  # the run's fresh factors: a function of (seed, name)
        for name, p in peft_model.named_parameters():
            if is_factor(name):
                p.copy_(fresh_factor(name.removeprefix(PEFT_PREFIX), p.shape, lora, spec.seed))
    opts = {"loss_type": "dr_grpo", "beta": 0.1, "reference": "adapters_disabled"}
    obj = grpo(**opts)
    names = {"names": obj.reward_names, "num_generations": G, "max_completion_length": MAX_LEN}
    loop = LOOP | {"lr": 5e-3, "objective": obj}
    groups = lambda: vt(frozen(1), dataclasses.replace(group(1), peft_config=lora))  # noqa: E731
    plan = built_trainer(spec, rollouts, loop, groups(), tmp_path).plan
    ref_losses, ref_metrics, ref = reference_grpo(
        spec, rollouts, TrainLoopConfig(**LOOP | {"lr": 5e-3}), opts | names, plan,
        peft_model=peft_model,
    )  # fmt: skip
    result = run_layout(spec, rollouts, loop, groups(), tmp_path, "lora", local=True)

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=ATOL)
    trained = {k: v for k, v in checkpoint_state(result.checkpoint).items() if is_factor(k)}
    factors = {k.removeprefix(PEFT_PREFIX): p.detach()
               for k, p in ref.named_parameters() if is_factor(k)}  # fmt: skip
    assert_params_close(trained, factors, 1e-5)
    assert_metrics(result, ref_metrics, ["kl", "reward", "clip_ratio/region_mean"])
    assert load_metrics(result)["kl"].iloc[0] == 0.0  # the policy starts as the reference
