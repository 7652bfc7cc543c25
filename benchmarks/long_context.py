"""Long vision sequences under a per-worker memory budget, side by side, in one run.

One small Qwen2.5-VL (a ~20M-parameter LLM with an 8k vocabulary, a depth-4 tower with
14-px patches), a global batch of 4 samples of one image each, 2 steps per point, every
layout on 4 worker processes:

- (a) ``ray.train.torch.TorchTrainer`` + FSDP2 (``fully_shard`` per block and layer, then
  the whole model) over the whole HF model, activation checkpointing, one sample per
  worker: what a Ray user writes today with the public API;
- (b) the seed's layout: vision Ulysses SP2 + LLM TP2, with activation checkpointing as
  in (a) and the chunked vocab-parallel loss, a sample per microbatch;
- (c) this project's best on 4 workers: vision SP2 + LLM CP2 x FSDP2 (the LLM's weights,
  gradients and AdamW state sharded over cp), activation checkpointing, the chunked loss;
- (d) as (c) without FSDP2 (every cp rank holds the whole LLM state);
- (e) and (f): (a) and (c) on a Qwen3-VL of the same sizes (its DeepStack features cross
  to the LLM at two levels besides the merged embeddings, and are sliced with the
  sequence under CP): the ratio of their largest sizes within the budget is reported
  (DeepStack adds crossings, so no goal is set for it).

The sweep: vision patches per sample before the merge (512, 1k, 2k, ... up to
``--max-patches``); a layout stops at its first size over ``--budget-mb`` or that fails.
Memory: each worker process's peak RSS (``VmHWM``, polled) over an idle Ray Train
worker's (torch, transformers and the loops imported, nothing built); the table shows the
largest worker's. Every worker of every layout runs with ``MALLOC_MMAP_THRESHOLD_`` =
``--mmap-threshold`` (1 MiB): the tiny model's activations are 1-16 MB blocks that glibc
would otherwise keep in a fragmenting heap, unlike a large model's. It prints per layout
and size: that peak, step time (the second step), LLM tokens/s and ``ray-disagg plan``'s
estimate of the largest worker; the largest size within the budget; and with ``--png`` a
plot of memory against patches with the budget as a line (extra ``plot``).

    python benchmarks/long_context.py [--max-patches 16384] [--budget-mb 450] [--png out.png]
"""

import argparse
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
import ray.train  # noqa: E402
from memory import _baseline_worker, fit, group  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from ray_disagg import (  # noqa: E402
    ContextParallel,
    DisaggregatedTrainer,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    load_metrics,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl_config,
)
from ray_disagg.data.examples import synthetic_samples  # noqa: E402

BATCH, STEPS = 4, 2
LOOP = {"max_steps": STEPS, "global_batch_size": BATCH, "lr": 1e-4}


SIZES = dict(vocab_size=8192, text_hidden=384, text_layers=6, text_heads=6, text_kv_heads=2,
             vision_hidden=128, vision_depth=4, vision_heads=4, patch_size=14)  # fmt: skip
FAMILY = {"a": "qwen2_5_vl", "b": "qwen2_5_vl", "c": "qwen2_5_vl", "d": "qwen2_5_vl",
          "e": "qwen3_vl", "f": "qwen3_vl"}  # fmt: skip


def make_config(family: str = "qwen2_5_vl"):
    """The benchmark's model: Qwen2.5-VL (windowed tower) or Qwen3-VL (DeepStack after
    tower blocks 1 and 2) of the same sizes."""
    if family == "qwen3_vl":
        cfg = tiny_qwen3_vl_config(**SIZES, deepstack_visual_indexes=(1, 2))
    else:
        cfg = tiny_qwen2_5_vl_config(**SIZES, window_size=112, fullatt_block_indexes=(1, 3))
    cfg.text_config.intermediate_size = 1536
    return cfg


def grid(patches: int) -> tuple[int, int, int]:
    """An image grid ``(1, h, w)`` of ``patches`` patches (h, w even, h <= w)."""
    h = 2 ** (int(math.log2(patches)) // 2)
    return (1, h, patches // h)


def samples(cfg, patches: int) -> list[dict]:
    return synthetic_samples(cfg, BATCH, grids=[grid(patches)])


def _fsdp_train(config):
    """(a): the whole HF model under FSDP2 on every worker, one sample each."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from ray_disagg.testing.reference import reference_batch

    spec, patches = config["spec"], config["patches"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = spec.build_full()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    for block in model.model.visual.blocks:
        fully_shard(block)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LOOP["lr"])
    mine = samples(spec.load_config(), patches)[rank::world][0]
    batch = reference_batch(spec, [mine])
    for step in range(STEPS):
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        metrics = {
            "step_time_s": time.perf_counter() - t0,
            "tokens": len(mine["input_ids"]) * world,
        }
        if step < STEPS - 1:
            ray.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:  # Result.metrics: checkpointed reports only
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def run_baseline(spec, patches: int, storage: str, layout: str = "a"):
    trainer = TorchTrainer(
        _fsdp_train,
        train_loop_config={"spec": spec, "patches": patches},
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name=f"{layout}_{patches}", storage_path=storage),
    )
    result, procs = fit(trainer)
    last = result.metrics
    return procs, last["step_time_s"], last["tokens"] / last["step_time_s"]


def layout_of(layout: str) -> tuple[dict, dict]:
    """``(groups, train_loop_config)`` of layout b, c, d or f."""
    if layout == "b":
        vision, text = SequenceParallel(size=2), TensorParallel(size=2)
    else:  # c, f: context parallel with the LLM's state sharded by FSDP2; d: without
        vision, text = SequenceParallel(size=2), ContextParallel(size=2, fsdp=layout != "d")
    loop = {**LOOP, "loss_chunk_tokens": 1024, "micro_batches": BATCH, "schedule": "sequential"}
    groups = {"vision": group(2, vision), "text": group(2, text)}
    for g in groups.values():
        g.activation_checkpointing = True
    return groups, loop


def planned_mb(spec, patches: int, layout: str) -> float:
    """``ray-disagg plan``'s estimate of the largest worker (MB) for this layout and size:
    its recipe with the sample's image and sequence length."""
    from types import SimpleNamespace

    from ray_disagg import TrainLoopConfig
    from ray_disagg.planner.memory import estimate

    groups, loop = layout_of(layout)
    t, h, w = grid(patches)
    sample = samples(spec.load_config(), patches)[0]
    plan = {"image_size": [h * 14, w * 14], "images_per_sample": 1}
    plan["seq_len"] = len(sample["input_ids"])
    recipe = SimpleNamespace(
        model=spec, groups=groups, loop=TrainLoopConfig(**loop), placement="separate", plan=plan
    )
    return max(m.total for m in estimate(recipe).values()) / 2**20


def run_ours(spec, patches: int, storage: str, layout: str):
    groups, loop = layout_of(layout)
    trainer = DisaggregatedTrainer(
        model=spec,
        groups=groups,
        train_loop_config=loop,
        datasets={"train": samples(spec.load_config(), patches)},
        run_config=RunConfig(name=f"{layout}_{patches}", storage_path=storage),
    )
    result, procs = fit(trainer)
    last = load_metrics(result).iloc[-1]
    groups = {g: float(last[f"{g}_peak_memory_mb"]) for g in ("vision", "text")}
    print(f"  rank-0 peaks by group (MB, absolute): {groups}")
    return procs, float(last["step_time_s"]), float(last["tokens_per_s"])


def baseline_mb(storage: str) -> float:
    trainer = TorchTrainer(
        _baseline_worker,
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="idle", storage_path=storage),
    )
    return float(trainer.fit().metrics["peak_mb"])


NAMES = {
    "a": "(a) TorchTrainer + FSDP2, AC",
    "b": "(b) vision SP2 + LLM TP2, AC, chunked",
    "c": "(c) vision SP2 + LLM CP2xFSDP2, AC, ch.",
    "d": "(d) as (c), LLM CP2 without FSDP2",
    "e": "(e) Qwen3-VL: TorchTrainer + FSDP2, AC",
    "f": "(f) Qwen3-VL: vision SP2 + LLM CP2xFSDP2",
}


def sweep(specs, sizes, budget: float, storage: str, base: float, layouts) -> dict:
    out = {k: {} for k in layouts}
    for layout in layouts:
        spec = specs[FAMILY[layout]]
        for patches in sizes:
            try:
                if layout in "ae":
                    procs, step, rate = run_baseline(spec, patches, storage, layout)
                else:
                    procs, step, rate = run_ours(spec, patches, storage, layout)
            except Exception as e:  # noqa: BLE001 - a failing size ends the layout
                print(f"{NAMES[layout]} at {patches} patches failed: {type(e).__name__}: {e}")
                break
            peak = max(procs) - base
            planned = planned_mb(spec, patches, layout) if layout not in "ae" else float("nan")
            out[layout][patches] = (peak, step, rate, planned)
            print(f"{NAMES[layout]:<40} {patches:>6} patches: peak {peak:7.0f} MB "
                  f"(plan {planned:5.0f}), step {step:6.2f} s, {rate:8.0f} tokens/s",
                  flush=True)  # fmt: skip
            if peak > budget:
                break
    return out


def report(out: dict, sizes, budget: float) -> dict:
    print(f"\nper-worker peak RSS over an idle worker (MB), budget {budget:.0f} MB:")
    print(f"{'layout':<40}" + "".join(f"{s:>9}" for s in sizes) + "   largest in budget")
    best = {}
    for layout, points in out.items():
        row = "".join(f"{points[s][0]:>9.0f}" if s in points else f"{'-':>9}" for s in sizes)
        fits = [s for s, (peak, *_) in points.items() if peak <= budget]
        best[layout] = max(fits, default=0)
        print(f"{NAMES[layout]:<40}{row}   {best[layout]}")
    print(f"\nstep time (s) / LLM tokens/s at {sizes[0]} patches:")
    for layout, points in out.items():
        if sizes[0] in points:
            _, step, rate, _ = points[sizes[0]]
            print(f"  {NAMES[layout]:<40} {step:7.2f} s  {rate:8.0f} tokens/s")
    print("\nray-disagg plan's estimate of the largest worker (MB) / measured peak over idle:")
    for layout, points in out.items():
        if layout not in "ae":
            row = "".join(f"{points[s][3] / points[s][0]:>9.2f}" if s in points else f"{'-':>9}"
                          for s in sizes)  # fmt: skip
            print(f"{NAMES[layout]:<40}{row}")
    if best.get("a"):
        for k in [k for k in ("b", "c", "d") if k in best]:
            print(f"{NAMES[k]}: {best[k] / best['a']:.1f}x the patches of (a) within budget")
        a, c = out["a"].get(sizes[0]), out.get("c", {}).get(sizes[0])
        if a and c:
            print(f"step time (c) / (a) at {sizes[0]} patches: {c[1] / a[1]:.2f}x (goal <= 1.0)")
    if best.get("e") and "f" in best:
        print(f"{NAMES['f']}: {best['f'] / best['e']:.1f}x the patches of (e) within budget")
    return best


def plot(out: dict, budget: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for layout, points in out.items():
        xs = sorted(points)
        ax.plot(xs, [points[x][0] for x in xs], marker="o", label=NAMES[layout])
    ax.axhline(budget, color="gray", linestyle="--", label=f"budget {budget:.0f} MB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vision patches per sample")
    ax.set_ylabel("peak RSS per worker over idle (MB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-patches", type=int, default=16384)
    p.add_argument("--min-patches", type=int, default=512)
    p.add_argument("--budget-mb", type=float, default=450.0)
    p.add_argument("--png", default=None, help="write the memory plot here")
    p.add_argument("--mmap-threshold", type=int, default=1 << 20, help="bytes; 0: defaults")
    p.add_argument("--layouts", default="abcef", help="which of a, b, c, d, e, f to run")
    a = p.parse_args()
    sizes = [a.min_patches * 2**k for k in range(64) if a.min_patches * 2**k <= a.max_patches]
    specs = {f: HFModelSpec(config=make_config(f), seed=0) for f in set(FAMILY.values())}
    for family in sorted({FAMILY[k] for k in a.layouts}):
        spec = specs[family]
        n = {p: sum(t.numel() for t in spec.meta_model(p).parameters()) for p in ("vision", "text")}
        print(f"{family}: LLM {n['text'] / 1e6:.1f}M params (8k vocab), tower "
              f"{n['vision'] / 1e6:.2f}M")  # fmt: skip
    print(f"global batch {BATCH}, {STEPS} steps per point, 4 workers per layout")
    # every layout's workers alike: glibc serves allocations above 1 MiB with mmap, so the
    # tiny model's 1-16 MB activations do not fragment the heap (a large model's are
    # far above glibc's default threshold); 0 keeps glibc's and the package's defaults
    env = {"MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)} if a.mmap_threshold else {}
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env}
    )
    with tempfile.TemporaryDirectory() as storage:
        base = baseline_mb(storage)
        print(f"idle worker: {base:.0f} MB")
        out = sweep(specs, sizes, a.budget_mb, storage, base, list(a.layouts))
    report(out, sizes, a.budget_mb)
    if a.png:
        plot(out, a.budget_mb, a.png)


if __name__ == "__main__":
    main()
