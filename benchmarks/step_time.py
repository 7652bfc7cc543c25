"""Step time and per-worker peak memory of parallel layouts, side by side, in one run.

CPU/gloo figures on a small model (they show overheads and relative costs on this
machine, not GPU throughput). Layouts: the single-process HF model, 1+1 workers, DP only
(2+2), vision Ulysses SP=2 + text TP=2 (trained in full, and with LoRA r=16 on every linear
of the LLM), and uniform TP=2 for both groups.

    python benchmarks/step_time.py [--steps 12] [--batch 8] [--only 1+1]
"""

import argparse
import dataclasses
import os
import re
import statistics
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import ray  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402

from ray_disagg import (  # noqa: E402
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples  # noqa: E402
from ray_disagg.testing.reference import reference_train  # noqa: E402
from ray_disagg.worker.memory import peak_memory_mb  # noqa: E402

# LoRA on every linear of the LLM (the vision tower trained in full)
LORA = LoraConfig(
    r=16,
    lora_alpha=32,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def group(n, parallelism="none"):
    return ModuleGroup(
        scaling_config=ScalingConfig(num_workers=n, resources_per_worker={"CPU": 0.5}),
        parallelism=parallelism,
    )


LAYOUTS = {
    "1+1 (vision 1, text 1)": lambda: (group(1), group(1)),
    "DP only (vision DP2, text DP2)": lambda: (group(2), group(2)),
    "vision SP2 + text TP2": lambda: (
        group(2, SequenceParallel(size=2)),
        group(2, TensorParallel(size=2)),
    ),
    "vision SP2 + text TP2, text LoRA r=16": lambda: (
        group(2, SequenceParallel(size=2)),
        dataclasses.replace(group(2, TensorParallel(size=2)), peft_config=LORA),
    ),
    "uniform TP2 (both groups)": lambda: (
        group(2, TensorParallel(size=2)),
        group(2, TensorParallel(size=2)),
    ),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--grid", type=int, default=16, help="image side in patches")
    p.add_argument("--only", help="run only the layouts whose name starts with this")
    args = p.parse_args()

    cfg = tiny_qwen2_5_vl_config(
        text_hidden=128,
        text_layers=4,
        vision_hidden=64,
        vision_depth=4,
        fullatt_block_indexes=(1, 3),
    )
    spec = HFModelSpec(config=cfg, seed=0)
    data = synthetic_samples(cfg, 4 * args.batch, grids=[(1, args.grid, args.grid)])
    loop = {"max_steps": args.steps, "global_batch_size": args.batch, "shuffle": False}

    torch.set_num_threads(1)  # like each Ray worker (OMP_NUM_THREADS=1)
    _, times, _ = reference_train(spec, data, TrainLoopConfig(**loop))
    ref_step = statistics.mean(times[1:])
    rows = [
        ("single-process HF model (1 process)", ref_step, peak_memory_mb(torch.device("cpu")), None)
    ]

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp()
    for name, make in LAYOUTS.items():
        if args.only and not name.startswith(args.only):
            continue
        vision, text = make()
        result = DisaggregatedTrainer(
            model=spec,
            groups={"vision": vision, "text": text},
            train_loop_config=loop,
            datasets={"train": data},
            run_config=RunConfig(name=re.sub(r"\W+", "-", name), storage_path=storage),
        ).fit()
        m = result.metrics
        rows.append(
            (name, m["mean_step_time_s"], m["vision_peak_memory_mb"], m["text_peak_memory_mb"])
        )
    ray.shutdown()

    tokens = sum(len(s["input_ids"]) for s in data[: args.batch])
    print(
        f"\nglobal batch {args.batch} samples, {tokens} text tokens, "
        f"{args.batch * args.grid**2} vision patches per step; {args.steps} steps\n"
    )
    print(f"{'layout':40s} {'step s':>8s} {'x 1-proc':>9s} {'vision MB':>10s} {'text MB':>8s}")
    for name, step, vmem, tmem in rows:
        tm = "" if tmem is None else f"{tmem:8.0f}"
        print(f"{name:40s} {step:8.3f} {step / ref_step:9.2f} {vmem:10.0f} {tm:>8s}")
    print(
        "\n(peak memory: resident set size of rank 0 of each group on CPU, "
        "max_memory_allocated on GPU)"
    )


if __name__ == "__main__":
    main()
