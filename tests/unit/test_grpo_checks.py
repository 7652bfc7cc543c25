"""Tier 1: the GRPO objective's settings (TRL's names and defaults), reward functions
checked as TRL calls them, recorded rollouts refused on the driver with the sample and
the fix named (no worker starts), its step values against TRL's formulas
(``tests.grpo_reference``, written independently), repeated batches for
``num_iterations``, and the metric lines."""

import math

import numpy as np
import pytest
import torch
from ray.train import ScalingConfig

from ray_disagg import (
    GRPO,
    ContextParallel,
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    SampleError,
    TokenLogps,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
    tiny_qwen2_vl_config,
)
from ray_disagg.config.layout import DataSpec
from ray_disagg.data.examples import save_word_tokenizer, synthetic_rollouts
from ray_disagg.launch.checks import resolve_objective
from ray_disagg.launch.progress import step_line
from ray_disagg.objectives.grpo import GRPOStep, nanstd
from tests.grpo_reference import advantages_and_metrics, compute_loss
from tests.rollout_data import prompts_of

CFG = tiny_qwen2_5_vl_config()
G = 4
ROLLOUTS = synthetic_rollouts(CFG, 8, G)


def exact(prompts, completions, **kwargs):
    return [0.0 for _ in completions]


def short(prompts, completions, completion_ids, **kwargs):
    return [float(len(c) < 4) for c in completion_ids]


def no_kwargs(prompts, completions, completion_ids):
    return []


def grpo(**kw) -> GRPO:
    return GRPO(**({"reward_funcs": [exact, short], "num_generations": G} | kw))


def test_trl_defaults_and_a_recipe_dict():
    obj = GRPO(reward_funcs=[exact])
    assert (obj.num_generations, obj.max_completion_length, obj.temperature) == (8, 512, 1.0)
    assert (obj.beta, obj.epsilon, obj.epsilon_high, obj.loss_type) == (0.0, 0.2, None, "dapo")
    assert (obj.scale_rewards, obj.importance_sampling_level, obj.num_iterations) == (
        "group", "token", 1,
    )  # fmt: skip
    assert not obj.needs_reference and grpo(beta=0.04).needs_reference
    assert grpo(scale_rewards=True).scale_rewards == "group"  # TRL's booleans
    assert grpo(scale_rewards=False).scale_rewards == "none"
    assert "kl" in grpo(beta=0.04).metric_names and "kl" not in obj.metric_names
    cfg = TrainLoopConfig(max_steps=1, global_batch_size=2, objective={
        "type": "grpo", "reward_funcs": ["tests.unit.test_grpo_checks:exact"],
        "num_generations": 2, "loss_type": "dr_grpo"})  # fmt: skip
    assert cfg.objective.reward_names == ("exact",) and cfg.objective.loss_type == "dr_grpo"
    assert "rewards/exact/mean" in cfg.objective.step_metric_names


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_generations": 1}, r"GRPO\(num_generations=1\): must be an int >= 2"),
        ({"epsilon": 0.0}, r"GRPO\(epsilon=0.0\): must be a finite float > 0"),
        ({"temperature": 0.0}, r"GRPO\(temperature=0.0\)"),
        ({"beta": -0.1}, r"GRPO\(beta=-0.1\)"),
        ({"loss_type": "ppo"}, r"loss_type='ppo'.*'dapo'"),
        ({"scale_rewards": "std"}, r"scale_rewards='std'.*'group'"),
        (
            {"reward_weights": [1.0]},
            r"reward_weights=.*one finite number per reward function \(2\)",
        ),
        ({"reward_funcs": []}, r"GRPO\(reward_funcs=\[\]\): give at least one"),
        ({"reward_funcs": [no_kwargs]}, r"reward_funcs=\[no_kwargs\]\).*add \*\*kwargs"),
        ({"reward_funcs": ["tests.unit.nothing:f"]}, r"cannot import it"),
        ({"reward_funcs": ["exact"]}, r"name a function as 'module:function'"),
        ({"reference": "precompute"}, r"reference='precompute'"),
    ],
)
def test_settings_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo(**kwargs)


def g(n=1):
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=n))


def make(data=ROLLOUTS, **loop):
    return DisaggregatedTrainer(
        model=HFModelSpec(config=CFG),
        groups={"vision": g(), "text": g()},
        train_loop_config={"max_steps": 2, "global_batch_size": 4, "objective": grpo()} | loop,
        datasets={"train": data},
    )


def bad(**change) -> list[dict]:
    return [dict(ROLLOUTS[0], **change), *ROLLOUTS[1:]]


def test_bad_rollouts_and_runs_refused_on_the_driver():
    r = ROLLOUTS[0]
    with pytest.raises(SampleError, match=r"sample 0 has no \['rewards'\]: GRPO trains on"):
        make(data=bad(rewards=None))
    with pytest.raises(SampleError, match=r"sample 0: rewards\['short'\] must hold one value"):
        make(data=bad(rewards={"exact": r["rewards"]["exact"]}))
    with pytest.raises(SampleError, match="sample 0 has 3 completions; num_generations=4"):
        make(data=bad(completion_ids=r["completion_ids"][:3]))
    long = [np.arange(3, 600) % 10 + 3, *r["completion_ids"][1:]]
    with pytest.raises(SampleError, match="completion 0 has 597 tokens; .*max_completion_length"):
        make(data=bad(completion_ids=long))
    with pytest.raises(SampleError, match="sample 0: truncated must hold one bool per"):
        make(data=bad(truncated=[False]))
    with pytest.raises(SampleError, match=r"sample 0 has no \['truncated'\]"):
        make(data=bad(truncated=None))
    iterations = grpo(num_iterations=2)
    with pytest.raises(ValueError, match=r"num_iterations=2\) with checkpoint_every=3.*of 2"):
        make(objective=iterations, checkpoint_every=3)
    with pytest.raises(ValueError, match=r"num_iterations=2\) with max_steps=3.*of 2"):
        make(objective=iterations, max_steps=3)
    with pytest.raises(ValueError, match=r"num_iterations=2\) trains several steps .*map-style"):
        make(objective=iterations, max_tokens_per_microbatch=200)


def test_repeated_batches_for_num_iterations():
    plan = make(objective=grpo(num_iterations=2), shuffle=True).plan
    assert plan.global_indices(0) == plan.global_indices(1) != plan.global_indices(2)
    assert plan.epoch_of(3) == 0 and plan.epoch_of(4) == 1  # 2 batches per epoch, twice each


def test_step_values_are_trls():
    obj = grpo(scale_rewards="batch", max_completion_length=6, mask_truncated_completions=True)
    step, metrics = obj.prepare_step(ROLLOUTS)
    opts = {"num_generations": G, "names": obj.reward_names, "scale_rewards": "batch"}
    adv, truncated, want = advantages_and_metrics(ROLLOUTS, opts)
    got = torch.tensor([a for p in range(len(ROLLOUTS)) for a in step.advantages[p]])
    torch.testing.assert_close(got, adv)
    for name, value in want.items():
        assert math.isclose(metrics[name], float(value), abs_tol=1e-6), name
    lengths = [len(c) for r in ROLLOUTS for c in r["completion_ids"]]
    kept = sum(n for n, t in zip(lengths, truncated.tolist()) if not t)
    assert step.tokens == kept and step.sequences == len(ROLLOUTS) * G
    assert metrics["frac_reward_zero_std"] == 0.0 and metrics["completions/clipped_ratio"] > 0


def test_nanstd_is_bessel_corrected_and_nan_for_one_value():
    x = torch.tensor([1.0, float("nan"), 3.0])
    assert float(nanstd(x)) == pytest.approx(float(torch.tensor([1.0, 3.0]).std()))
    assert math.isnan(float(nanstd(torch.tensor([2.0, float("nan")]))))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_metrics_are_trls_on_padded_tensors(loss_type, level):
    """One microbatch holding the whole batch: the objective on flat label tokens equals
    TRL's formulas on ``(completions, positions)`` tensors."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 5, 2, 3, 4]
    n, width = len(lengths), max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).float()
    logps = -torch.rand(n, width, generator=gen) * mask
    old = (logps + 0.2 * torch.randn(n, width, generator=gen)) * mask
    ref = (logps + 0.3 * torch.randn(n, width, generator=gen)) * mask
    adv = torch.randn(n, generator=gen)
    opts = {"loss_type": loss_type, "importance_sampling_level": level, "beta": 0.05,
            "epsilon": 0.1, "epsilon_high": 0.15, "max_completion_length": 6}  # fmt: skip
    want_loss, want = compute_loss(logps, old, ref, adv, mask, opts)
    obj = grpo(**opts, num_iterations=2)
    keep = mask.bool()
    samples = [{"id": 0}, {"id": 1}]
    step = GRPOStep(advantages=[adv[:4].tolist(), adv[4:].tolist()], kept=[[1.0] * 4] * 2,
                    sequences=float(n), tokens=float(sum(lengths)))  # fmt: skip
    policy = logps[keep].clone().requires_grad_()
    inputs = TokenLogps(
        policy=policy, reference=ref[keep], old=old[keep],
        sequence=torch.arange(n).unsqueeze(1).expand(n, width)[keep],
        tokens=torch.tensor(lengths, dtype=torch.float32), samples=samples, positions=[0, 1],
        global_samples=2.0, global_sequences=float(n), global_tokens=float(sum(lengths)), step=step,
    )  # fmt: skip
    loss, metrics = obj.loss(inputs)
    torch.testing.assert_close(loss, want_loss)
    for name, value in want.items():
        torch.testing.assert_close(metrics[name], value, msg=name)


def test_the_step_line_shows_the_reward():
    m = {"step": 2, "loss": 0.5, "reward": 0.25, "lr": 1e-3, "tokens_per_s": 10.0,
         "step_time_s": 1.0}  # fmt: skip
    assert "reward 0.2500" in step_line(m, 4)


def needs_solution(prompts, completions, solution, **kwargs):
    return [0.0 for _ in completions]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_word_tokenizer(path)
    return str(path)


def test_generating_runs_refused_on_the_driver(tokenizer_dir):
    """Prompts (no completion_ids): GRPO generates; what it cannot do is refused before
    any worker starts, naming the setting and the fix."""
    prompts = prompts_of(CFG, 8)
    obj = grpo(tokenizer=tokenizer_dir, max_completion_length=8)
    assert make(data=prompts, objective=obj).loop_config.objective.rollouts == "generate"
    assert make().loop_config.objective.rollouts == "recorded"  # the samples carry them
    with pytest.raises(ValueError, match=r"GRPO\(tokenizer=<a local tokenizer directory"):
        make(data=prompts)
    with pytest.raises(SampleError, match=r"sample 0 has no column \['solution'\] that reward fu"):
        funcs = [exact, needs_solution]
        make(data=[{k: v for k, v in p.items() if k != "solution"} for p in prompts],
             objective=grpo(tokenizer=tokenizer_dir, reward_funcs=funcs))  # fmt: skip
    with pytest.raises(ValueError, match=r"sample 0.*max_completion_length=8 exceed .*max_seq_len"):
        make(data=prompts, objective=obj, pack_sequences=True, max_seq_len=12)
    labelled = dict(prompts[0], labels=np.asarray(prompts[0]["input_ids"]))
    with pytest.raises(SampleError, match="sample 0 has labelled tokens .*PromptProcessor"):
        make(data=[labelled, *prompts[1:]], objective=obj)
    with pytest.raises(ValueError, match="holds prompts to complete .*objective does not gen"):
        resolve_objective(TrainLoopConfig(max_steps=1, global_batch_size=4),
                          DataSpec(kind="stream", prompts=True), {}, ["text"])  # fmt: skip
    with pytest.raises(ValueError, match=r"GRPO generates completions of prompts but .*Prompt"):
        resolve_objective(TrainLoopConfig(max_steps=1, global_batch_size=4, objective=obj),
                          DataSpec(kind="stream", prompts=False), {}, ["text"])  # fmt: skip
    with pytest.raises(ValueError, match="max_tokens_per_microbatch plans each step from"):
        make(data=prompts, objective=obj, max_tokens_per_microbatch=200)
    with pytest.raises(ValueError, match="context parallelism splits each sequence"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": g(), "text": ModuleGroup(
                scaling_config=ScalingConfig(num_workers=2), parallelism=ContextParallel(size=2))},
            train_loop_config={"max_steps": 2, "global_batch_size": 4, "objective": obj},
            datasets={"train": prompts},
        )  # fmt: skip
    with pytest.raises(ValueError, match="the qwen2_vl family does not generate yet"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=tiny_qwen2_vl_config()),
            groups={"vision": g(), "text": g()},
            train_loop_config={"max_steps": 2, "global_batch_size": 4, "objective": obj},
            datasets={"train": prompts},
        )
    with pytest.raises(ValueError, match=r"GRPO: validation sets are evaluated under .* GRPO's"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": g(), "text": g()},
            train_loop_config={"max_steps": 2, "global_batch_size": 4, "objective": grpo()},
            datasets={"train": ROLLOUTS, "validation": ROLLOUTS[:4]},
        )


def test_validation_rewards_are_means_over_scored_completions():
    obj = grpo(reward_weights=[1.0, 2.0])
    sums = obj.eval_sums([{"exact": [1.0], "short": [None]}, {"exact": [None], "short": [None]},
                          {"exact": [0.0], "short": [0.5]}])  # fmt: skip
    assert obj.eval_metrics(sums) == {
        "eval_reward": (1.0 + 0.0 + 2 * 0.5) / 2,  # the unscored completion left out
        "eval_rewards/exact/mean": 0.5,
        "eval_rewards/short/mean": 0.5,
    }


def test_a_refusal_elsewhere_leaves_grpo_validation_accepted(tokenizer_dir):
    """Refusals are collected: one of another setting (a freeze prefix matching nothing)
    does not make GRPO's validation and eval_every look refused too."""
    from ray_disagg.config.layout import resolve
    from ray_disagg.config.refusals import refusals_of

    obj = grpo(tokenizer=tokenizer_dir, max_completion_length=8)
    one = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    typo = ModuleGroup(scaling_config=ScalingConfig(num_workers=1), freeze=["model.nothing"])
    loop = {"max_steps": 2, "global_batch_size": 4, "eval_every": 1, "objective": obj}
    data = DataSpec(kind="stream", prompts=True, validation=True)
    model = HFModelSpec(config=CFG)
    assert resolve(model, {"vision": one, "text": one}, loop, data=data).loop.eval_every == 1
    with pytest.raises(ValueError) as refused:
        resolve(model, {"vision": typo, "text": one}, loop, data=data)
    assert [("model.nothing" in str(e)) for e in refusals_of(refused.value)] == [True]
