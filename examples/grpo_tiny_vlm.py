"""Teach a tiny Qwen2.5-VL to name handwritten digits with GRPO, on Ray Train.

CPU only, no download. The images are scikit-learn's handwritten digits (8x8, upscaled
to 16x16), the vocabulary the tiny model's words (``ray_disagg.data.examples.WORDS``).

1. **SFT**, a fixed budget (``--sft-steps`` steps of ``--batch-size`` captions such as
   "a handwritten seven", images 0-1199): the model learns the format and about half of
   the digits.
2. **GRPO** from the exported SFT model (its directory holds the tokenizer, which decodes
   the completions for the reward function): each prompt is an image and the words "a
   handwritten" (the same images), ``--generations`` completions are sampled on the
   training groups, and the reward is 1 when the completion names the image's digit
   (TRL's reward-function signature, the record's ``solution`` column).

Accuracy is measured before and after GRPO on ``--held-out`` images never trained on
(from 1597 on): the HF model exported from each stage completes each prompt greedily
(``generate``), and a completion is right when it is the image's digit word.

    python examples/grpo_tiny_vlm.py [--seed 0] [--sft-steps 80] [--grpo-steps 250]

It prints ``accuracy X% -> Y%`` and fails unless Y is at least X + 20 (``--skip-check``:
print only). ``ray-disagg plot <the GRPO run's directory>`` draws the reward curve.
Measured on a 2-core CPU (2026-12-07), about 150 s a seed: 54.0% -> 78.0% (seed 0),
39.0% -> 76.0% (seed 1), 48.5% -> 73.0% (seed 2).
"""

import argparse
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on 127.0.0.1

HELD_OUT_START = 1597


def exact(prompts, completions, solution, **kwargs):
    """1.0 when the completion is the image's digit word and nothing else (its
    end-of-turn token dropped by the decoding; TRL's reward-function signature)."""
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def prompts_of(cfg, n: int, start: int = 0) -> list[dict]:
    """The digits as prompts ending with "a handwritten": the completion names the digit."""
    import numpy as np

    from ray_disagg.data.examples import WORDS, digit_prompts

    lead = [WORDS.index("a"), WORDS.index("handwritten")]
    return [{**p, "input_ids": np.concatenate([p["input_ids"], lead])}
            for p in digit_prompts(cfg, n, start=start)]  # fmt: skip


def accuracy(model_dir: str, prompts: list[dict]) -> int:
    """How many of ``prompts`` the HF model in ``model_dir`` completes greedily with the
    image's digit word."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from ray_disagg import HFModelSpec

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = HFModelSpec(pretrained_path=model_dir).adapter
    right = 0
    for p in prompts:
        inputs = adapter.reference_inputs([p])
        inputs.pop("labels")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=0)
        text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += text.strip() == p["solution"]
    return right


def fit(spec, loop: dict, data: list, name: str, root: str, seed: int):
    from ray.train import RunConfig, ScalingConfig

    from ray_disagg import DisaggregatedTrainer, ModuleGroup

    def group():
        return ModuleGroup(scaling_config=ScalingConfig(num_workers=1))

    trainer = DisaggregatedTrainer(
        model=spec,
        groups={"vision": group(), "text": group()},
        train_loop_config={"seed": seed, "shuffle": True, **loop},
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=os.path.join(root, "runs")),
    )
    return trainer.fit()


def main(argv=None):
    """Run both stages; returns ``(accuracy before, accuracy after, the GRPO run's
    Result)``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=80, help="0: GRPO from the initial model")
    p.add_argument("--grpo-steps", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=16, help="captions (SFT) or prompts (GRPO)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--grpo-lr", type=float, default=1e-3)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--train-images", type=int, default=1200, help="images 0.. trained on")
    p.add_argument("--reward-workers", type=int, default=0, help="score in Ray tasks")
    p.add_argument("--skip-check", action="store_true", help="do not fail on the accuracy")
    args = p.parse_args(argv)
    if not 0 < args.train_images <= HELD_OUT_START or not 0 < args.held_out <= 200:
        p.error(f"--train-images 1..{HELD_OUT_START} (the held-out images follow) and "
                "--held-out 1..200 (scikit-learn has 1797 digits)")  # fmt: skip

    import ray

    from ray_disagg import GRPO, HFModelSpec, export_hf, load_metrics, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import EOS, digits_samples, save_word_tokenizer

    root = tempfile.mkdtemp(prefix="grpo_tiny_vlm_")
    cfg = tiny_qwen2_5_vl_config()
    cfg.text_config.eos_token_id = EOS  # a completion ends at <eos>
    held_out = prompts_of(cfg, args.held_out, start=HELD_OUT_START)
    if not ray.is_initialized():  # else the cluster it runs in (e.g. the tests')
        cpus = 3 + args.reward_workers  # the groups, the driver's share, the reward tasks
        ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False)  # fmt: skip

    sft_dir = os.path.join(root, "sft")
    if args.sft_steps:
        sft_loop = {"max_steps": args.sft_steps, "global_batch_size": args.batch_size,
                    "lr": args.sft_lr, "checkpoint_every": args.sft_steps}  # fmt: skip
        sft = fit(HFModelSpec(config=cfg, seed=args.seed), sft_loop,
                  digits_samples(cfg, args.train_images), "sft", root, args.seed)  # fmt: skip
        export_hf(sft.checkpoint, sft_dir)
    else:  # no SFT (a smoke run): GRPO from the initial model
        HFModelSpec(config=cfg, seed=args.seed).build_full().save_pretrained(sft_dir)
    save_word_tokenizer(sft_dir)
    before = accuracy(sft_dir, held_out)

    objective = GRPO(reward_funcs=[exact], num_generations=args.generations,
                     max_completion_length=2, temperature=1.0, loss_type="dapo",
                     reward_workers=args.reward_workers)  # fmt: skip
    grpo_loop = {"max_steps": args.grpo_steps, "global_batch_size": args.batch_size,
                 "lr": args.grpo_lr, "checkpoint_every": args.grpo_steps,
                 "objective": objective}  # fmt: skip
    grpo = fit(HFModelSpec(pretrained_path=sft_dir), grpo_loop,
               prompts_of(cfg, args.train_images), "grpo", root, args.seed)  # fmt: skip
    grpo_dir = save_word_tokenizer(export_hf(grpo.checkpoint, os.path.join(root, "grpo")))
    after = accuracy(grpo_dir, held_out)

    frame = load_metrics(grpo)
    cols = ["step", "reward", "reward_std", "completions/mean_length", "rollout_s", "train_s"]
    cols = [c for c in cols if c in frame]
    print(frame[cols].iloc[:: max(1, len(frame) // 8)].to_string(index=False))
    print(f"reward curve: ray-disagg plot {grpo.path}")
    n = len(held_out)
    print(f"accuracy {100 * before / n:.1f}% -> {100 * after / n:.1f}% on {n} held-out images")
    if 5 * (after - before) < n and not args.skip_check:  # in counts: no rounding
        raise SystemExit("GRPO did not raise the accuracy by 20 points")
    return before / n, after / n, grpo


if __name__ == "__main__":
    main()
