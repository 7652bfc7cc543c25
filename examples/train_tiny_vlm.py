"""Train a tiny Qwen2.5-VL on scikit-learn's handwritten digits with DisaggregatedTrainer.

CPU only, no download: the model is randomly initialised from a tiny config, the images
ship with scikit-learn, the captions are "a handwritten seven". The vision tower and the
LLM each train in their own Ray Train worker group. The loss curve of every step is saved
as ``loss_curve.png`` in the run directory, next to the checkpoints.

    python examples/train_tiny_vlm.py [--steps 60] [--vision-workers 1] [--text-workers 1]

Standalone it starts its own Ray on 127.0.0.1. With ``RAY_ADDRESS`` set (as Ray Jobs sets
it for the entrypoint) or ``--address``, it joins that cluster instead (absolute paths:
without a runtime_env working_dir the job's working directory is the cluster's, not yours):

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 -- \
        "$PWD/.venv/bin/python" "$PWD/examples/train_tiny_vlm.py" --storage /tmp/runs
"""

import argparse
import math
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vision-workers", type=int, default=1)
    parser.add_argument("--text-workers", type=int, default=1)
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="microbatches per step (1F1B from 2)"
    )
    parser.add_argument(
        "--trace-steps",
        type=int,
        nargs="*",
        default=[],
        help="steps whose actions are recorded for `ray-disagg plot RUN_DIR`'s timeline",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="each worker's dense peak TFLOP/s, for MFU (a GPU's is known)",
    )
    parser.add_argument(
        "--storage",
        default=None,
        help="RunConfig storage_path (default: a new temporary directory). Rerunning with the "
        "same storage continues the run from its latest checkpoint.",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: $RAY_ADDRESS, which Ray Jobs sets for the "
        "entrypoint; with neither, a local Ray is started on 127.0.0.1).",
    )
    parser.add_argument(
        "--skip-loss-check",
        action="store_true",
        help="Do not fail when the loss has not halved (for smoke runs of a few steps).",
    )
    return parser.parse_args()


def init_ray(args: argparse.Namespace) -> None:
    """Join the given cluster, or start a local one on loopback. Imports Ray: the loopback
    setting below is read when Ray is imported."""
    if args.address or os.environ.get("RAY_ADDRESS"):
        import ray

        # An existing cluster has its resources: ray.init refuses num_cpus/num_gpus.
        ray.init(address=args.address)  # None: RAY_ADDRESS
        return
    # Ray 2.60 turns 127.0.0.1 into the external interface address unless this is 0; it
    # must be in the environment before Ray is imported (the raylet and workers inherit it).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(
        num_cpus=max(2, args.vision_workers + args.text_workers),
        _node_ip_address="127.0.0.1",
    )


def main() -> None:
    args = parse_args()
    init_ray(args)

    from ray.train import CheckpointConfig, RunConfig, ScalingConfig

    from ray_disagg import (
        DisaggregatedTrainer,
        HFModelSpec,
        ModuleGroup,
        tiny_qwen2_5_vl_config,
    )
    from ray_disagg.data.examples import digits_samples
    from ray_disagg.plotting import plot_metrics

    config = tiny_qwen2_5_vl_config()
    trainer = DisaggregatedTrainer(
        model=HFModelSpec(config=config, seed=0),
        groups={
            "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=args.vision_workers)),
            "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=args.text_workers)),
        },
        train_loop_config={
            "lr": 3e-3,
            "max_steps": args.steps,
            "global_batch_size": args.batch_size,
            "checkpoint_every": 20,
            "micro_batches": args.micro_batches,
            "trace_steps": args.trace_steps,
            "peak_tflops": args.peak_tflops,
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
    losses = ", ".join(f"step {row.step} {row.loss:.4f}" for row in history.itertuples())
    print(f"loss at each checkpoint: {losses}")
    initial = math.log(config.text_config.vocab_size)  # loss of the random initial model
    last = result.metrics["loss"]
    print(f"final loss {last:.4f}, down from about ln(vocab) = {initial:.2f} at step 1")
    if "://" not in str(result.path):  # every step's metrics are kept for local storage only
        print(f"loss curve: {plot_metrics(result, os.path.join(result.path, 'loss_curve.png'))}")
    if not args.skip_loss_check and not last < 0.5 * initial:
        raise SystemExit(f"loss did not fall enough: {initial:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main()
