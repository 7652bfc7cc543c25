"""Tier 1: the DPO objective's settings, its losses and metrics against TRL's formulas
(written independently in ``tests.preference_data``), the sequence of each label
position (padded, packed, a context slice's), and bad preference input refused on the
driver with the sample and the fix named (no worker starts)."""

import dataclasses

import numpy as np
import pytest
import torch
from ray.train import ScalingConfig

from ray_disagg import (
    DPO,
    DataParallel,
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    SampleError,
    TokenLogps,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_pairs, synthetic_samples
from ray_disagg.models.loss import loss_index
from ray_disagg.models.packing import PACKED_KEY
from ray_disagg.worker.objective import repeat_rows, sequence_index
from tests.preference_data import trl_pair_loss

CFG = tiny_qwen2_5_vl_config()
PAIRS = synthetic_pairs(CFG, 8)
LOOP = {"max_steps": 1, "global_batch_size": 4, "objective": {"type": "dpo", "beta": 0.1}}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 0.0}, r"DPO\(beta=0.0\): must be a finite float > 0"),
        ({"beta": -1.0}, r"DPO\(beta=-1.0\)"),
        ({"loss_type": "kto"}, r"loss_type='kto'.*'sigmoid'"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, r"label_smoothing=0.5.*\[0, 0.5\)"),
        ({"label_smoothing": 0.1}, "applies to loss_type='robust' only"),
        ({"reference": "frozen"}, r"reference='frozen'.*'precompute'"),
    ],
)
def test_dpo_settings_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPO(**kwargs)


def test_objective_from_a_dict_and_unknown_keys():
    cfg = TrainLoopConfig.from_any(
        {
            "max_steps": 1,
            "global_batch_size": 2,
            "objective": {"type": "dpo", "beta": 0.3, "loss_type": "ipo"},
        }
    )
    assert cfg.objective == DPO(beta=0.3, loss_type="ipo")
    with pytest.raises(ValueError, match=r"unknown keys \['gamma'\] for type='dpo'"):
        TrainLoopConfig(max_steps=1, global_batch_size=2, objective={"type": "dpo", "gamma": 1})
    with pytest.raises(ValueError, match="give an Objective"):
        TrainLoopConfig(max_steps=1, global_batch_size=2, objective="dpo")


@pytest.mark.parametrize(
    "dpo",
    [
        DPO(beta=0.1),
        DPO(beta=0.3, loss_type="hinge"),
        DPO(beta=0.5, loss_type="ipo"),
        DPO(beta=0.2, loss_type="robust", label_smoothing=0.2),
    ],
    ids=lambda d: d.loss_type,
)
def test_dpo_losses_and_metrics_are_trls(dpo):
    g = torch.Generator().manual_seed(0)
    policy, ref = -10 * torch.rand(6, 2, generator=g), -10 * torch.rand(6, 2, generator=g)
    tokens = torch.randint(1, 9, (6, 2), generator=g).float()
    inputs = sequence_totals(policy.flatten(), ref.flatten(), tokens.flatten(), 12.0)
    loss, metrics = dpo.loss(inputs)
    want = trl_pair_loss(dpo.loss_type, dpo.beta, dpo.label_smoothing)(policy, ref, tokens)
    torch.testing.assert_close(loss, want.sum() / 12.0)
    rewards = dpo.beta * (policy - ref)
    margins = (rewards[:, 0] - rewards[:, 1]).sum() / 12.0
    torch.testing.assert_close(metrics["rewards/margins"], margins)
    acc = (rewards[:, 0] > rewards[:, 1]).float().sum() / 12.0
    torch.testing.assert_close(metrics["rewards/accuracies"], acc)
    torch.testing.assert_close(metrics["logps/rejected"], policy[:, 1].sum() / 12.0)
    assert set(metrics) == set(dpo.metric_names)


def sequence_totals(policy, ref, tokens, global_samples: float) -> TokenLogps:
    """Each sequence's totals as one token each (the sum of one value is itself)."""
    n = len(policy)
    return TokenLogps(
        policy=policy, reference=ref, old=None, sequence=torch.arange(n), tokens=tokens,
        samples=[{}] * (n // 2), positions=list(range(n // 2)), global_samples=global_samples,
        global_sequences=2 * global_samples,
        global_tokens=float(tokens.sum()),
    )  # fmt: skip


def test_sequence_of_each_label_position():
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8]])
    batch = {"input_ids": torch.zeros_like(labels), "labels": labels}
    index = loss_index(labels)
    assert sequence_index(batch, index).tolist() == [0, 0, 1, 1]
    # one packed row: items of 3 and 4 tokens; an item's first label is never a target
    packed = torch.tensor([[-100, 5, 6, -100, -100, 7, 8]])
    batch = {
        "input_ids": torch.zeros_like(packed),
        "labels": packed,
        PACKED_KEY: [(0, 0, 3, None), (0, 3, 4, None)],
    }
    assert sequence_index(batch, loss_index(packed)).tolist() == [0, 0, 1, 1]
    # a context slice [3, 7) of that row: its next-token targets are 7, 8
    targets = torch.tensor([[-100, -100, 7, 8, -100, -100, -100]])[:, 2:6]
    index = loss_index(targets, shifted=True)
    assert sequence_index(batch, index, (3, 7)).tolist() == [1, 1]


def test_repeat_rows_gives_both_answers_the_prompts_rows_and_sums_their_gradients():
    x = torch.arange(5.0).unsqueeze(1).requires_grad_()
    out = repeat_rows({"img": x}, {"img": [2, 0, 3]}, [2, 2, 2])
    assert out["img"].flatten().tolist() == [0, 1, 0, 1, 2, 3, 4, 2, 3, 4]
    out["img"].sum().backward()
    assert x.grad.flatten().tolist() == [2.0] * 5


def g(n=1, parallelism="none"):
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=n), parallelism=parallelism)


def make(data=PAIRS, loop=LOOP, groups=None, **kwargs):
    return DisaggregatedTrainer(
        model=HFModelSpec(config=CFG),
        groups={"vision": g(), "text": g()} if groups is None else groups,
        train_loop_config=loop,
        datasets={"train": data, **kwargs},
    )


def bad(**change) -> list[dict]:
    return [dict(PAIRS[0], **change), *PAIRS[1:]]


def test_pairs_construct_and_the_batch_counts_pairs():
    trainer = make(loop=LOOP | {"assignment": "balanced"})
    assert trainer.plan.steps_per_epoch == 2
    chosen, rejected = (len(PAIRS[0][f"{a}_input_ids"]) for a in ("chosen", "rejected"))
    assert trainer.plan.costs["text"][0] == chosen + rejected  # a pair moves whole


def test_bad_pairs_refused_on_the_driver():
    p = PAIRS[0]
    with pytest.raises(SampleError, match=r"sample 0 has no .*an SFT sample: train it without"):
        make(data=synthetic_samples(CFG, 8))
    with pytest.raises(SampleError, match=r"sample 0 is a preference pair.*DPO"):
        make(loop={"max_steps": 1, "global_batch_size": 4})
    with pytest.raises(SampleError, match="sample 0: chosen and rejected are identical"):
        make(data=bad(rejected_input_ids=p["chosen_input_ids"], rejected_labels=p["chosen_labels"]))
    empty = np.full_like(p["rejected_labels"], -100)
    with pytest.raises(SampleError, match="sample 0: the rejected answer is empty"):
        make(data=bad(rejected_labels=empty))
    with pytest.raises(SampleError, match=r"sample 0 has no \['chosen_labels'\]"):
        make(data=bad(chosen_labels=None))
    ids = p["rejected_input_ids"].copy()
    ids[0] = 3  # the prompt's first token
    with pytest.raises(SampleError, match="sample 0: the prompt .* differs between chosen and"):
        make(data=bad(rejected_input_ids=ids))
    precompute = LOOP | {"objective": DPO(reference="precompute")}
    with pytest.raises(
        SampleError,
        match=r"sample at index 0 has no int or str 'id' \(got None\): .*precompute.*unique",
    ):
        make(data=[{k: v for k, v in p.items() if k != "id"}, *PAIRS[1:]], loop=precompute)
    with pytest.raises(SampleError, match="samples 0 and 1 have the same id 0"):
        make(data=[p, dict(PAIRS[1], id=0), *PAIRS[2:]], loop=precompute)
    n = len(p["rejected_input_ids"])
    packed = LOOP | {"pack_sequences": True, "max_seq_len": n - 1}
    with pytest.raises(ValueError, match=rf"sample 0 has {n} tokens, more than .*max_seq_len"):
        make(loop=packed)


def test_runs_a_preference_objective_does_not_take_yet_are_refused():
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible by the text"):
        make(groups={"vision": g(), "text": g(3, DataParallel())})
    with pytest.raises(ValueError, match=r"objective'\]=DPO: validation sets are evaluated under"):
        make(validation=PAIRS)


def test_the_reference_model_is_decided_on_the_driver():
    from peft import LoraConfig

    def lora(**kw):
        config = LoraConfig(**({"r": 4, "target_modules": ["q_proj", "v_proj"]} | kw))
        return dataclasses.replace(g(), peft_config=config)

    frozen = dataclasses.replace(g(), trainable=False)
    chosen = make(groups={"vision": frozen, "text": lora()}).loop_config.objective.reference
    assert chosen == "adapters_disabled"  # every trained part has a fresh adapter
    assert make(groups={"vision": g(), "text": lora()}).loop_config.objective.reference == "copy"
    assert make().loop_config.objective.reference == "copy"
    off = LOOP | {"objective": DPO(reference="adapters_disabled")}
    cases = [
        ({"vision": g(), "text": lora()}, r"the \['vision'\] part\(s\) train in full"),
        ({"vision": frozen, "text": lora(modules_to_save=["norm"])}, "trains modules_to_save"),
        ({"vision": frozen, "text": lora(init_lora_weights=False)}, "lora_B starts non-zero"),
    ]
    for groups, match in cases:
        with pytest.raises(ValueError, match=match + ".*use reference='copy'"):
            make(loop=off, groups=groups)
