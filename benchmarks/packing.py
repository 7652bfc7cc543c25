"""Sequence packing vs padding of the LLM part, side by side, in one run.

A length-skewed dataset: per global batch of 8, seven short samples (a small image and a
short caption, 11 tokens) and one long text-only sample (~``--long`` tokens). Padded,
the LLM computes 8 rows as long as the long sample; packed (``pack_sequences=True``,
``max_seq_len``), the samples share rows. Two short ``DisaggregatedTrainer`` fits (1 vision
+ 1 text worker, 1 CPU each) on the same data and weights; LLM tokens/s counts real
(unpadded) tokens, so the two columns are comparable. The first step's loss is the same
in both (packing changes the layout, not the math).

    python benchmarks/packing.py [--steps 6] [--long 480] [--max-seq-len 1024]
"""

import argparse
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import numpy as np  # noqa: E402
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


def skewed_samples(cfg, n: int, long_tokens: int) -> list[dict]:
    """``n`` samples; every 8th (position 3 of each batch of 8) is text-only and padded
    out with ``long_tokens`` random caption tokens, the others have one small image."""
    grids = [(1, 4, 4)] * 3 + [None] + [(1, 4, 4)] * 4
    samples = synthetic_samples(cfg, n, grids=grids)
    rng = np.random.default_rng(0)
    for s in samples[3::8]:
        extra = rng.integers(1, 100, long_tokens)
        s["input_ids"] = np.concatenate([s["input_ids"], extra])
        s["labels"] = np.concatenate([s["labels"], extra])
    return samples


def group() -> ModuleGroup:
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}))


def fit(spec, data, loop, storage, name) -> dict:
    result = DisaggregatedTrainer(
        model=spec,
        groups={"vision": group(), "text": group()},
        train_loop_config=loop,
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()
    df = load_metrics(result).sort_values("step")
    warm = df.iloc[1:]  # without the warm-up step
    return {
        "loss1": float(df["loss"].iloc[0]),
        "tokens_per_s": float(warm["tokens_per_s"].mean()),
        "step_s": float(warm["step_time_s"].mean()),
        "text_s": float(warm["text_compute_s"].mean()),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--long", type=int, default=480, help="extra tokens of the long samples")
    p.add_argument("--max-seq-len", type=int, default=1024)
    args = p.parse_args()
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp()

    cfg = tiny_qwen2_5_vl_config(text_hidden=256, text_layers=4, text_heads=8, text_kv_heads=4)
    spec = HFModelSpec(config=cfg, seed=0)
    data = skewed_samples(cfg, 8 * args.steps, args.long)
    lengths = [len(s["input_ids"]) for s in data]
    base = {"max_steps": args.steps, "global_batch_size": 8, "shuffle": False}
    packed_loop = {**base, "pack_sequences": True, "max_seq_len": args.max_seq_len}
    rows = {
        "padded": fit(spec, data, base, storage, "padded"),
        "packed": fit(spec, data, packed_loop, storage, "packed"),
    }
    ray.shutdown()

    print(
        f"\n1 vision + 1 text worker (1 CPU each), global batch 8, {args.steps} steps; "
        f"sample lengths: median {int(np.median(lengths))}, max {max(lengths)} tokens; "
        f"max_seq_len {args.max_seq_len}\n"
    )
    print(f"{'':8s} {'LLM tokens/s':>13s} {'step s':>8s} {'text compute s':>15s} {'loss@1':>9s}")
    for name, r in rows.items():
        print(
            f"{name:8s} {r['tokens_per_s']:13.0f} {r['step_s']:8.3f} {r['text_s']:15.3f} "
            f"{r['loss1']:9.5f}"
        )
    speedup = rows["packed"]["tokens_per_s"] / rows["padded"]["tokens_per_s"]
    print(f"\npacked / padded tokens/s: {speedup:.2f}x")


if __name__ == "__main__":
    main()
