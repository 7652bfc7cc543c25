"""Microbatch pipelining and cost-balanced assignment, side by side, in one run.

Part 1: one vision and one text worker, each on its own CPU, a model sized so both groups
compute about equally (and small enough that two workers computing at once do not slow
each other down much on a 2-core machine): step time of the sequential schedule with 1
and 4 microbatches and of 1F1B with 4, with each group's bubble fraction (the share of the
step it does not compute).
Part 2: vision DP=2 + text 1 on a skewed global batch (one large image, seven small):
step time with contiguous vs balanced assignment.

    python benchmarks/pipeline.py [--steps 8]
"""

import argparse
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import ray  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402

from ray_disagg import (  # noqa: E402
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples  # noqa: E402


def group(n: int) -> ModuleGroup:
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=n, resources_per_worker={"CPU": 1}))


def fit(spec, data, loop, vision_workers, storage, name):
    result = DisaggregatedTrainer(
        model=spec,
        groups={"vision": group(vision_workers), "text": group(1)},
        train_loop_config=loop,
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()
    df = load_metrics(result).sort_values("step").iloc[1:]  # without the warm-up step
    step = df["step_time_s"].mean()
    return {  # bubble: the share of the step a group does not compute
        "step": step,
        "vision_bubble": 1 - df["vision_compute_s"].mean() / step,
        "text_bubble": 1 - df["text_compute_s"].mean() / step,
        "in_flight": int(df["vision_max_in_flight"].max()),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    ray.init(num_cpus=3, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp()

    cfg = tiny_qwen2_5_vl_config(
        text_hidden=224, text_layers=4, vision_hidden=96, vision_depth=4,
        fullatt_block_indexes=(1, 3),
    )  # fmt: skip
    spec = HFModelSpec(config=cfg, seed=0)
    data = synthetic_samples(cfg, 32, grids=[(1, 16, 16)])
    base = {"max_steps": args.steps, "global_batch_size": 8, "shuffle": False}
    rows = {}
    for name, extra in [
        ("sequential, k=1", {"micro_batches": 1, "schedule": "sequential"}),
        ("sequential, k=4", {"micro_batches": 4, "schedule": "sequential"}),
        ("1F1B, k=4", {"micro_batches": 4, "schedule": "1f1b"}),
    ]:
        rows[name] = fit(spec, data, {**base, **extra}, 1, storage, name.replace(", ", "-"))
    ref = rows["sequential, k=1"]["step"]
    print(f"\n1 vision + 1 text worker (1 CPU each), global batch 8, {args.steps} steps\n")
    print(f"{'schedule':18s} {'step s':>8s} {'x seq k=1':>10s} {'vision bubble':>14s} "
          f"{'text bubble':>12s} {'max in flight':>14s}")  # fmt: skip
    for name, r in rows.items():
        print(
            f"{name:18s} {r['step']:8.3f} {r['step'] / ref:10.2f} {r['vision_bubble']:14.2f} "
            f"{r['text_bubble']:12.2f} {r['in_flight']:14d}"
        )

    small_text = tiny_qwen2_5_vl_config(
        text_hidden=64, text_layers=2, vision_hidden=128, vision_depth=4,
        fullatt_block_indexes=(1, 3),
    )  # fmt: skip
    spec = HFModelSpec(config=small_text, seed=0)
    skewed = synthetic_samples(small_text, 32, grids=[(1, 20, 20)] + [(1, 8, 8)] * 7)
    loop = {**base, "schedule": "sequential"}
    bal = {}
    for assignment in ("contiguous", "balanced"):
        bal[assignment] = fit(
            spec, skewed, {**loop, "assignment": assignment}, 2, storage, assignment
        )
    print("\nvision DP=2 + text 1, one 20x20-patch image and seven 8x8 per global batch\n")
    print(f"{'assignment':12s} {'step s':>8s} {'x contiguous':>13s}")
    for name, r in bal.items():
        print(f"{name:12s} {r['step']:8.3f} {r['step'] / bal['contiguous']['step']:13.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
