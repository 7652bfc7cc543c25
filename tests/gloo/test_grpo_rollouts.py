"""Tier 2 (the groups' workers without Ray, ``testing.local``): GRPO that generates its
completions on the training groups (``GRPO(rollouts="generate")``: each step's prompts
encoded once by the encoder group, ``num_generations`` completions per prompt sampled
by the LLM group as it is placed for training, rewards on its leaders) equals an
independently written single-process GRPO that samples each completion token by token
from full forwards of the HF model (HF's warpers, the same per-completion noise), calls
the reward functions as TRL does and applies TRL's formulas: losses and parameters
within 1e-5 relative, the reward and length metrics within 1e-6 (a single different
token would change them). Layouts: vision SP2 + text TP2 (a trained tower that encodes
each prompt twice a step: the rollout's pass and the update's with gradients; the
vocabulary split while sampling); a frozen tower whose rollout rows serve the update
(one encode per prompt per step) + text FSDP2 (2) in lockstep, 2 microbatches,
``num_iterations=2`` (the second step reuses the completions), a KL to a copy and the
rewards in ``reward_workers`` calls (in process under the local runner; Ray tasks on a
cluster: the docs' example)."""

import dataclasses

import numpy as np
import pytest
import torch
from ray.train import Checkpoint

from ray_disagg import (
    GRPO,
    DataParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import NUMBER_WORDS, save_word_tokenizer
from ray_disagg.rollout.sampling import completion_keys
from tests.grpo_reference import reference_grpo, rollout_records, sample_completions
from tests.helpers import (
    assert_params_close,
    built_trainer,
    checkpoint_state,
    group,
    losses,
    run_layout,
    vt,
)
from tests.rollout_data import prompts_of

G, MAX_LEN, SEED = 4, 5, 3
STOP = (2, *range(6, 16))  # <eos> and the number words end a completion
LOOP = {"global_batch_size": 4, "max_steps": 3, "eps": 1e-6, "seed": SEED, "lr": 5e-3}
SAMPLING = {"temperature": 0.9, "top_k": 60, "top_p": 0.95}


def parity(prompts, completions, solution, **kwargs):
    """1.0 when the completion ends with a digit of the same parity as the prompt's."""
    odd = {w: i % 2 for i, w in enumerate(NUMBER_WORDS)}
    return [float(odd.get(c.split()[-1] if c else None) == odd[s])
            for c, s in zip(completions, solution)]  # fmt: skip


def brief(prompts, completions, completion_ids, **kwargs):
    return [-0.1 * len(c) for c in completion_ids]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = tiny_qwen2_5_vl_config()
    cfg.text_config.eos_token_id = list(STOP)
    path = tmp_path_factory.mktemp("tokenizer")
    save_word_tokenizer(path)
    return HFModelSpec(config=cfg, seed=4), prompts_of(cfg, 8), str(path), prompts_of(cfg, 4, 7)


def frozen(n: int):
    return dataclasses.replace(group(n), trainable=False)


CASES = {
    "vision-sp2-text-tp2-dapo-validation": (
        lambda: vt(group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2))),
        {"eval_every": 3},
        {"loss_type": "dapo", "epsilon_high": 0.28, **SAMPLING},
    ),
    "frozen-vision-text-fsdp2-1f1b-bnpo-masked-2-iterations-kl": (
        lambda: vt(frozen(1), group(2, DataParallel(fsdp=True))),
        {"micro_batches": 2, "max_steps": 4},
        {
            "loss_type": "bnpo",
            "num_iterations": 2,
            "beta": 0.04,
            "reference": "copy",
            "mask_truncated_completions": True,
            "scale_rewards": "none",
            "reward_workers": 2,
        },  # fmt: skip
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generating_grpo_equals_single_process_sampling_and_trl(setup, tmp_path, case):
    spec, prompts, tokenizer_dir, val_prompts = setup
    groups, loop, opts = CASES[case]
    validation = val_prompts if "eval_every" in loop else None
    obj = GRPO(reward_funcs=[parity, brief], num_generations=G, max_completion_length=MAX_LEN,
               tokenizer=tokenizer_dir, **opts)  # fmt: skip
    run = LOOP | loop | {"objective": obj}
    plan = built_trainer(spec, prompts, run, groups(), tmp_path, validation=validation).plan
    settings = opts | {"names": obj.reward_names, "num_generations": G,
                       "max_completion_length": MAX_LEN}  # fmt: skip
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731

    def rollout(model, step, batch):
        keys = completion_keys(SEED, step, range(len(batch)), G)  # batch positions
        model.eval()
        completions, truncated = sample_completions(spec, model, batch, keys, settings, STOP)
        model.train()
        return rollout_records(batch, completions, truncated, [parity, brief], decode, G)

    ref_losses, ref_metrics, ref_model = reference_grpo(
        spec, prompts, TrainLoopConfig(**LOOP | loop), settings, plan, rollout=rollout,
        groups=groups(),
    )  # fmt: skip
    result = run_layout(
        spec, prompts, run, groups(), tmp_path, case, local=True, validation=validation
    )

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=1e-7)
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), 1e-5)
    frame = load_metrics(result)
    names = ["reward", "reward_std", "rewards/parity/mean", "rewards/brief/mean",
             "completions/mean_length", "completions/clipped_ratio", *obj.metric_names]  # fmt: skip
    for name in names:
        want = [m[name] for m in ref_metrics]
        torch.testing.assert_close(frame[name].tolist(), want, atol=1e-6, rtol=0.0, msg=name)
    clipped = frame["completions/clipped_ratio"]
    assert ((clipped > 0) & (clipped < 1)).any()  # some stopped, some ran to the end
    assert frame["rewards/parity/mean"].max() > 0  # the text reward saw decoded completions
    images = [sum(int(prompts[i].get("image_grid_thw") is not None)
                  for i in plan.global_indices(s)) for s in range(run["max_steps"])]  # fmt: skip
    passes = 1 if "frozen" in case else 2  # a frozen tower: once; a trained one: twice
    assert frame["images"].tolist() == [n * passes for n in images]
    generating = [s % obj.num_iterations == 0 for s in range(run["max_steps"])]
    assert [s > 0 for s in frame["rollout_s"]] == generating
    if validation is not None:  # greedy completions of the prompts after the last step
        ref_model.eval()
        greedy, _ = sample_completions(spec, ref_model, validation, None, settings, STOP, True)
        want = rollout_records(validation, greedy, [False] * 4, [parity, brief], decode, 1)
        rewards = [[s["rewards"][n][0] for s in want] for n in ("parity", "brief")]
        evaluated = frame.dropna(subset=["eval_reward"])
        assert evaluated.index.tolist() == [frame.index[-1]]
        got = evaluated.iloc[0]
        assert got["eval_reward"] == pytest.approx(np.sum(rewards) / 4, abs=1e-6)
        assert got["eval_rewards/brief/mean"] == pytest.approx(np.mean(rewards[1]), abs=1e-6)


CALLS = []


def flaky(prompts, completions, **kwargs):
    """Fails at its second call (the second step's rollout; in the LLM leader's
    process)."""
    CALLS.append(1)
    if len(CALLS) == 2:
        raise ZeroDivisionError("no verifier")
    return [0.0 for _ in completions]


def calm(prompts, completions, **kwargs):
    """:func:`flaky` where it does not fail."""
    return [0.0 for _ in completions]


def test_a_failing_reward_function_fails_the_step_then_a_resume_is_bit_identical(setup, tmp_path):
    """The step whose reward function raises fails on every rank, naming the function
    and the prompts, and saves nothing; resumed from the last checkpoint, the run draws
    the same completions (keys of (seed, step, prompt id, completion)): its loss and
    weights equal an uninterrupted run's bit for bit."""
    spec, prompts, tokenizer_dir, _ = setup

    def loop(fn):
        obj = GRPO(reward_funcs=[brief, fn], num_generations=2, max_completion_length=3,
                   tokenizer=tokenizer_dir, **SAMPLING)  # fmt: skip
        return LOOP | {"max_steps": 2, "checkpoint_every": 1, "objective": obj}

    groups = lambda: vt(frozen(1), group(1))  # noqa: E731
    why = r"rollout of step 2: reward function flaky raised on prompts \[(\d, ){3}\d\]: ZeroDi"
    with pytest.raises(RuntimeError, match=why):
        run_layout(spec, prompts, loop(flaky), groups(), tmp_path, "flaky", local=True)
    saved = sorted((tmp_path / "flaky").glob("checkpoint_*"))
    assert [p.name for p in saved] == ["checkpoint_000001"]  # nothing of the failed step
    resumed = run_layout(spec, prompts, loop(calm), groups(), tmp_path, "resumed", local=True,
                         resume=Checkpoint.from_directory(str(saved[0])))  # fmt: skip
    clean = run_layout(spec, prompts, loop(calm), groups(), tmp_path, "clean", local=True)
    assert losses(resumed) == losses(clean)[1:]
    got, want = checkpoint_state(resumed.checkpoint), checkpoint_state(clean.checkpoint)
    assert all(torch.equal(got[k], want[k]) for k in want)
