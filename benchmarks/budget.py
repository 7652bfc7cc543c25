"""Token-budget batching vs fixed batches of the same mean token count, side by side, in
one run.

A length-skewed dataset: most samples short (text-only or a small image, a caption of
8-40 tokens), every ``--every``-th a long video (``--frames`` frames of 16x16 patches:
about 64 LLM tokens and 256 patches a frame). Two ``DisaggregatedTrainer`` fits on Ray
(1 vision + 2 text workers, half a CPU each; 2 microbatches, rows padded to the longest
sample of each microbatch): one with ``max_tokens_per_microbatch`` (each step takes the
samples that fit), one with a fixed ``global_batch_size`` set to the budget run's mean
samples per step. From each run's own plan: the padded-token waste (padding over all the
LLM's row tokens), the largest microbatch in padded tokens (what sizes the LLM's
activations), and from its metrics the step time (mean, and the slowest step) and LLM
tokens/s (real tokens).

    python benchmarks/budget.py [--steps 12] [--budget 384] [--frames 4] [--every 10]
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


def skewed_samples(cfg, n: int, frames: int, every: int) -> list[dict]:
    """Short samples with captions of 8-40 tokens; every ``every``-th a long video."""
    grids = [None, (1, 4, 4), None, (1, 8, 4)] * every
    grids[every - 1] = {"videos": [(frames, 16, 16)]}
    samples = synthetic_samples(cfg, n, grids=grids[:every])
    rng = np.random.default_rng(0)
    for s in samples:
        extra = rng.integers(1, 100, int(rng.integers(5, 37)))
        s["input_ids"] = np.concatenate([s["input_ids"], extra])
        s["labels"] = np.concatenate([s["labels"], extra])
    return samples


def group(n: int) -> ModuleGroup:
    return ModuleGroup(
        scaling_config=ScalingConfig(num_workers=n, resources_per_worker={"CPU": 0.5})
    )


def waste(plan, lengths, steps: int) -> tuple[float, int]:
    """(padding / row tokens over the steps, the largest microbatch in padded tokens)."""
    pad = rows = biggest = 0
    for s in range(steps):
        indices = plan.global_indices(s)
        for mb in plan.assign(s):
            for share in mb["text"]:
                n = [lengths[indices[p]] for p in share]
                padded = len(n) * max(n)
                pad, rows, biggest = pad + padded - sum(n), rows + padded, max(biggest, padded)
    return pad / rows, biggest


def fit(spec, data, loop, storage, name) -> dict:
    trainer = DisaggregatedTrainer(
        model=spec,
        groups={"vision": group(1), "text": group(2)},
        train_loop_config=loop,
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=storage),
    )
    lengths = [len(s["input_ids"]) for s in data]
    wasted, biggest = waste(trainer.plan, lengths, loop["max_steps"])
    df = load_metrics(trainer.fit()).sort_values("step").iloc[1:]  # without the warm-up
    return {
        "samples": float(df["samples"].mean()),
        "tokens": float((df["tokens_per_s"] * df["step_time_s"]).mean()),
        "waste": wasted,
        "biggest": biggest,
        "step_s": float(df["step_time_s"].mean()),
        "slowest_s": float(df["step_time_s"].max()),
        "tokens_per_s": float(df["tokens_per_s"].mean()),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--budget", type=int, default=384, help="max_tokens_per_microbatch")
    p.add_argument("--frames", type=int, default=4, help="frames of each long video")
    p.add_argument("--every", type=int, default=10, help="one long video in this many")
    args = p.parse_args()
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp()

    cfg = tiny_qwen2_5_vl_config(text_hidden=256, text_layers=4, text_heads=8, text_kv_heads=4)
    spec = HFModelSpec(config=cfg, seed=0)
    data = skewed_samples(cfg, 64 * args.steps, args.frames, args.every)
    lengths = [len(s["input_ids"]) for s in data]
    base = {"max_steps": args.steps, "micro_batches": 2, "seed": 1}
    budget = fit(spec, data, base | {"global_batch_size": 256,
                                     "max_tokens_per_microbatch": args.budget},
                 storage, "budget")  # fmt: skip
    b = max(4, 4 * round(budget["samples"] / 4))  # 2 replicas x 2 microbatches
    rows = {f"fixed {b}": fit(spec, data, base | {"global_batch_size": b}, storage, "fixed"),
            f"budget {args.budget}": budget}  # fmt: skip
    ray.shutdown()

    print(
        f"\n1 vision + 2 text workers (0.5 CPU each), 2 microbatches, {args.steps} steps; "
        f"sample lengths: median {int(np.median(lengths))}, max {max(lengths)} tokens "
        f"(one long video in {args.every})\n"
    )
    head = ("samples/step", "tokens/step", "padding", "largest mb", "step s", "slowest s",
            "tokens/s")  # fmt: skip
    print(f"{'':12s}" + "".join(f"{h:>13s}" for h in head))
    for name, r in rows.items():
        print(
            f"{name:12s}{r['samples']:13.1f}{r['tokens']:13.0f}{r['waste']:12.1%} "
            f"{r['biggest']:12d}{r['step_s']:13.3f}{r['slowest_s']:13.3f}"
            f"{r['tokens_per_s']:13.0f}"
        )


if __name__ == "__main__":
    main()
