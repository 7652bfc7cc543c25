"""The planner's cost model against measurements, in one run on this machine.

1. Calibrates the device figures on the local Ray cluster
   (:func:`ray_disagg.planner.calibrate.calibrate`: micro-benchmarks, then seven short
   runs of the model: tower 1 + LLM 1 with 1 and 2 microbatches, LLM data parallel over
   2, activation checkpointing, bf16 autocast, LLM TP2, LLM FSDP2 over 2). Those runs
   are the measurements of their layouts below (marked ``*``).
2. Trains a small Qwen2.5-VL (~55M-parameter LLM, ~5M tower; fp32 AdamW, synthetic
   samples of one 64 px image, 64 LLM tokens) in at least six layouts for a few steps each
   and prints, side by side, the measured and predicted step time (the median of the
   faster half of the steps after the first two: other processes only slow a step) and
   each group's memory per worker: the rank-0 peak resident set of its steps minus an
   idle worker's, against the planner's estimate. Then the
   Spearman rank correlation of the step times (must be >= 0.8) and the largest memory
   error (must be within 15%).
3. Prints, from the nominal (uncalibrated) GPU figures, the planner's choice for the
   bundled ``qwen2_5_vl_32b_8gpu`` recipe on one node of 8 H200-class GPUs against
   uniform TP8 (vision and LLM both TP8 on every GPU).

Every worker takes one logical CPU (one thread) and runs with glibc's
``MALLOC_MMAP_THRESHOLD_`` at 1 MiB (this small model's 1-16 MB tensors would otherwise
stay in a heap that does not shrink, and the resident set would not follow the live
tensors); the cluster is described as 2 cores, which the cost model shares between the
workers busy at once.

    python benchmarks/planner.py [--steps 6] [--layouts all]
"""

import argparse
import dataclasses
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import ray  # noqa: E402

from ray_disagg.config.groups import DataParallel, TensorParallel  # noqa: E402
from ray_disagg.planner import cost  # noqa: E402
from ray_disagg.planner.calibrate import (  # noqa: E402
    calibrate,
    measure_layout,
    sample_workload,
    samples,
)
from ray_disagg.planner.cluster import NOMINAL, Cluster, parse_cluster  # noqa: E402
from ray_disagg.planner.render import render_auto  # noqa: E402
from ray_disagg.planner.search import Candidate, group_for, plan_auto  # noqa: E402
from ray_disagg.recipes.recipe import load_recipe  # noqa: E402

MODEL = {
    "preset": "tiny_qwen2_5_vl",
    "vocab_size": 8192,
    "text_hidden": 768,
    "text_layers": 8,
    "text_heads": 8,
    "text_kv_heads": 4,
    "vision_hidden": 256,
    "vision_depth": 6,
    "vision_heads": 8,
}
RECIPE = {
    "model": {"config": MODEL, "seed": 0},
    "data": {"train": {"type": "digits", "num_samples": 64, "image_size": 64}},
    "groups": {"vision": {"num_workers": 1}, "text": {"num_workers": 1}},
    "train_loop_config": {"max_steps": 6, "global_batch_size": 8},
    "plan": {"image_size": [64, 64], "images_per_sample": 1, "seq_len": 70},
}
# name -> (placement, vision (workers, parallelism, ac), text (...), micro_batches, bf16)
LAYOUTS = {
    "v1+t1": ("separate", (1, DataParallel(), False), (1, DataParallel(), False), 1, False),
    "v1+t1 1f1b k4": ("separate", (1, DataParallel(), False), (1, DataParallel(), False), 4, False),
    "v1+t1 colocated": (
        "colocated",
        (1, DataParallel(), False),
        (1, DataParallel(), False),
        1,
        False,
    ),  # fmt: skip
    "v1+t1 ac": ("separate", (1, DataParallel(), True), (1, DataParallel(), True), 1, False),
    "v1+t2 dp": ("separate", (1, DataParallel(), False), (2, DataParallel(), False), 1, False),
    "v1+t2 tp2": (
        "separate",
        (1, DataParallel(), False),
        (2, TensorParallel(size=2), False),
        1,
        False,
    ),  # fmt: skip
    "v1+t2 fsdp2": (
        "separate",
        (1, DataParallel(), False),
        (2, DataParallel(fsdp=True), False),
        1,
        False,
    ),  # fmt: skip
    "v2+t1": ("separate", (2, DataParallel(), False), (1, DataParallel(), False), 1, False),
    "v1+t1 bf16": ("separate", (1, DataParallel(), False), (1, DataParallel(), False), 1, True),
    "v1+t1 1f1b k2": ("separate", (1, DataParallel(), False), (1, DataParallel(), False), 2, False),
    "v2+t1 ac": ("separate", (2, DataParallel(), True), (1, DataParallel(), True), 1, False),
    "v1+t2 dp k2": ("separate", (1, DataParallel(), False), (2, DataParallel(), False), 2, False),
    "v1+t2 fsdp2 ac": (
        "separate",
        (1, DataParallel(), True),
        (2, DataParallel(fsdp=True), True),
        1,
        False,
    ),  # fmt: skip
}


def layout(r, spec):
    placement, v, t, k, bf16 = spec
    groups = {
        p: group_for(r.groups[p], n, par, ac, False, 1)
        for p, (n, par, ac) in (("vision", v), ("text", t))
    }
    return cost.with_layout(r, groups=groups, placement=placement, micro_batches=k, bf16=bf16)


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry))
    return 1 - 6 * d2 / (n * (n * n - 1))


def warm_up(storage: str) -> None:
    """A short fit whose figures are not used: Ray's worker pool, the imports and the
    page cache are warm before the first measured run (the calibration's anchor)."""
    r = load_recipe(RECIPE)
    measure_layout(layout(r, LAYOUTS["v1+t1"]), 3, storage)


def validate(steps: int, names: list[str], storage: str) -> bool:
    cluster = Cluster(cpus_per_node=2, host_memory_gib=24, interconnect="loopback")
    r = load_recipe(RECIPE)
    r = dataclasses.replace(r, model=cost.CachedModel(r.model))
    figures, runs = calibrate(r, cluster, steps=steps, storage=storage)
    known = {Candidate(x).describe(): got for x, got in runs}  # measured while calibrating
    for x, got in runs:
        print(f"calibration run {Candidate(x).describe()}: {got}", flush=True)
    print(f"calibrated: {dataclasses.asdict(figures)}\n", flush=True)
    data = samples(r)
    r, work = sample_workload(r, data)
    facts = cost.model_facts(r)
    rows, measured_s, predicted_s, errors = [], [], [], []
    for name in names:
        cand = layout(r, LAYOUTS[name])
        pred = cost.predict(cand, facts, work, cluster, figures)
        got = known.get(Candidate(cand).describe())
        mark = " *" if got else ""  # a calibration run: its time fitted a figure
        got = got or measure_layout(cand, steps, storage, data)
        cells = [name + mark, f"{got['step_s']:.2f}", f"{pred.step_s:.2f}"]
        for part in ("vision", "text"):
            have = got[f"{part}_peak_mb"] - figures.idle_mb
            want = pred.memory[part] / 2**20
            errors.append(abs(want - have) / have)
            cells.append(f"{have:.0f} / {want:.0f} ({100 * (want - have) / have:+.0f}%)")
        rows.append(cells)
        measured_s.append(got["step_s"])
        predicted_s.append(pred.step_s)
        print("  ".join(cells), flush=True)
    head = ["layout", "measured s", "predicted s", "vision MB meas/pred", "text MB meas/pred"]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    print()
    for row in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print("* a calibration run (its measured step time fitted one of the figures)")
    rho = spearman(measured_s, predicted_s)
    worst = max(errors)
    print(f"\nSpearman rank correlation of step times: {rho:.3f} (must be >= 0.8)")
    print(f"largest memory error: {100 * worst:.1f}% (must be <= 15%)")
    return rho >= 0.8 and worst <= 0.15


def big_recipe() -> None:
    cluster = parse_cluster("nodes=1,gpus_per_node=8,gpu_memory_gib=141")
    r = load_recipe("qwen2_5_vl_32b_8gpu")
    result = plan_auto(r, cluster, NOMINAL["gpu"])
    print("\nqwen2_5_vl_32b_8gpu on 8 x 141 GiB GPUs (nominal figures, uncalibrated):")
    print(render_auto(result, top=3))
    model = cost.CachedModel(r.model)
    r = dataclasses.replace(r, model=model)
    tp = TensorParallel(size=8)
    groups = {p: group_for(g, 8, tp, True, True, 0.5) for p, g in r.groups.items()}
    k = r.loop.micro_batches
    tp8 = cost.with_layout(r, groups=groups, placement="colocated", micro_batches=k)
    facts, work = cost.model_facts(r), cost.workload(r)
    base = cost.predict(tp8, facts, work, cluster, NOMINAL["gpu"])
    best = result.ranked[0].prediction
    print(
        f"uniform TP8 (vision and LLM TP8 on every GPU): {base.step_s:.3f} s/step, "
        f"{base.per_device['bundle'] / 2**30:.1f} GiB per GPU; the planner's choice "
        f"{best.step_s:.3f} s/step: {base.step_s / best.step_s:.2f}x "
        "(published reference: 1.26-1.37x over uniform TP)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", default="all")
    parser.add_argument("--skip-measure", action="store_true")
    args = parser.parse_args()
    names = list(LAYOUTS) if args.layouts == "all" else args.layouts.split(",")
    ok = True
    if not args.skip_measure:
        env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False, logging_level="WARNING",
                 runtime_env={"env_vars": env})  # fmt: skip
        with tempfile.TemporaryDirectory() as storage:
            warm_up(storage)
            ok = validate(args.steps, names, storage)
        ray.shutdown()
    big_recipe()
    print("\nPASS" if ok else "\nFAIL")


if __name__ == "__main__":
    main()
