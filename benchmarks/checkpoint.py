"""What a checkpoint costs the step that writes it, synchronous against
``async_checkpoint``, in one run.

The model is ``benchmarks/memory.py``'s Qwen2.5-VL with a ~300M-parameter LLM (``--size``;
its fp32 parameters and AdamW state are ~4.9 GB per checkpoint, so the write is a real
cost), vision 1 + text 1, a checkpoint every 3 steps, every step reported. Each step's
wall time is the interval between two lines of the run's ``metrics.jsonl`` (polled every
20 ms). A step's line is written before its checkpoint, so the checkpoint's cost lands in
the interval that ends at the next line: ``checkpoint step`` is the mean of those
intervals, ``normal step`` the median of the others (the first two steps left out:
warm-up, AdamW state allocation). The last step's checkpoint (always synchronous) is not
counted. Each checkpoint's interval is printed too: the first asynchronous one also
allocates the staging buffers that the later ones reuse.

    python benchmarks/checkpoint.py [--size 300m|tiny] [--steps 8] [--cache DIR]
"""

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import ray  # noqa: E402
from ray.train import CheckpointConfig, RunConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402
from recovery import bench_model, timed_fit  # noqa: E402

EVERY = 3


def run(async_checkpoint: bool, spec, data, storage: str, steps: int) -> dict:
    name = "async" if async_checkpoint else "sync"
    run_config = RunConfig(
        name=name, storage_path=storage, checkpoint_config=CheckpointConfig(num_to_keep=1)
    )
    loop = {
        "max_steps": steps,
        "global_batch_size": 4,
        "checkpoint_every": EVERY,
        "report_every": 1,
        "lr": 1e-4,
        "async_checkpoint": async_checkpoint,
    }
    result, seen, _, fit_s = timed_fit(spec, data, loop, run_config)
    arrived = {step: t for t, step in seen}  # 1-based step -> its line
    after_ckpt, normal = [], []
    for step in range(3, steps + 1):  # the interval ending at ``step``'s line
        dt = arrived[step] - arrived[step - 1]
        (after_ckpt if (step - 1) % EVERY == 0 else normal).append(dt)
    return {
        "normal": statistics.median(normal),
        "ckpt": statistics.mean(after_ckpt),
        "each": after_ckpt,
        "fit": fit_s,
        "loss": result.metrics["loss"],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="300m", choices=["300m", "tiny"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cache", default="/tmp/ray_disagg_bench", help="saved model directory")
    args = p.parse_args()
    spec, n, data = bench_model(memory.SIZES[args.size], args.size, args.cache)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.cache) as storage:
        for mode in (False, True):
            rows[mode] = run(mode, spec, data, storage, args.steps)
    ray.shutdown()
    print(
        f"\nQwen2.5-VL, LLM {n:.0f}M parameters; vision 1 + text 1; "
        f"a checkpoint every {EVERY} steps"
    )
    print(
        f"{'checkpoints':<14}{'normal step':>12}{'checkpoint step':>17}{'ratio':>8}{'fit':>9}  loss"
    )
    for mode, label in ((False, "synchronous"), (True, "asynchronous")):
        r = rows[mode]
        print(
            f"{label:<14}{r['normal']:>11.2f}s{r['ckpt']:>16.2f}s{r['ckpt'] / r['normal']:>7.2f}x"
            f"{r['fit']:>8.1f}s  {r['loss']:.6f}"
        )
        each = ", ".join(f"{t:.2f}s ({t / r['normal']:.2f}x)" for t in r["each"])
        print(f"  {label} checkpoint steps, in order: {each}")
    print("target: the asynchronous checkpoint step <= 1.2x a normal step")


if __name__ == "__main__":
    main()
