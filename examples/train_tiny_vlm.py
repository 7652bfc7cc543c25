"""Train a tiny Qwen2.5-VL on scikit-learn's handwritten digits with DisaggregatedTrainer.

CPU only, no download: the model is randomly initialised from a tiny config, the images
ship with scikit-learn, the captions are "a handwritten seven". The vision tower and the
LLM each train in their own Ray Train worker group.

    python examples/train_tiny_vlm.py [--steps 60] [--vision-workers 1] [--text-workers 1]
"""

import argparse
import math
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import ray  # noqa: E402
from ray.train import CheckpointConfig, RunConfig, ScalingConfig  # noqa: E402

from ray_disagg import (  # noqa: E402
    DisaggregatedTrainer,
    ModuleGroup,
    Qwen2_5_VLSpec,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.examples_data import digits_samples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vision-workers", type=int, default=1)
    parser.add_argument("--text-workers", type=int, default=1)
    parser.add_argument(
        "--storage",
        default=None,
        help="RunConfig storage_path (default: a new temporary directory). Rerunning with the "
        "same storage continues the run from its latest checkpoint.",
    )
    args = parser.parse_args()

    ray.init(num_cpus=max(2, args.vision_workers + args.text_workers))
    config = tiny_qwen2_5_vl_config()
    trainer = DisaggregatedTrainer(
        model=Qwen2_5_VLSpec(config=config, seed=0),
        groups={
            "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=args.vision_workers)),
            "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=args.text_workers)),
        },
        train_loop_config={
            "lr": 3e-3,
            "max_steps": args.steps,
            "global_batch_size": args.batch_size,
            "checkpoint_every": 20,
        },
        datasets={"train": digits_samples(config, n=args.samples)},
        run_config=RunConfig(
            name="tiny-vlm-digits",
            storage_path=args.storage or tempfile.mkdtemp(prefix="ray_disagg_"),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )
    result = trainer.fit()

    history = result.metrics_dataframe.sort_values("step")
    print("\nloss at each checkpoint:")
    for row in history.itertuples():
        print(f"  step {row.step:4d}  loss {row.loss:.4f}")
    initial = math.log(config.text_config.vocab_size)  # loss of the random initial model
    last = result.metrics["loss"]
    print(f"final loss {last:.4f}, down from about ln(vocab) = {initial:.2f} at step 1")
    print(f"tokens/s {result.metrics['tokens_per_s']:.0f}, checkpoint: {result.checkpoint.path}")
    if not last < 0.5 * initial:
        raise SystemExit(f"loss did not fall enough: {initial:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main()
