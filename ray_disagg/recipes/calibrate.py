"""``ray-disagg plan --auto --calibrate``: measure the device figures of the connected Ray
cluster for the planner's cost model (:mod:`ray_disagg.recipes.cost`).

1. Micro-benchmarks, each in a Ray task of one device: the bf16/fp32 matmul speed ratio,
   the memory bandwidth (a large copy), a gloo all-reduce between two workers of one
   node (the collective and transfer bandwidths) and an idle worker's resident memory.
2. Two short runs of the recipe's model on synthetic samples shaped like its workload
   (tower 1 + LLM 1, separate, sequential) with 1 and 2 microbatches: their step times
   give the achieved FLOP/s and the fixed seconds per microbatch (the cost model is
   linear in both for these layouts), their peak memory over the idle worker's the
   memory scale of each kind of group.

On a 2-core CPU machine it takes a few minutes; the figures go to a JSON file that later
``plan --auto`` runs read (``--figures``; default ``~/.cache/ray_disagg/``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from ray_disagg.recipes import cost
from ray_disagg.recipes.cluster import Cluster

__all__ = ["calibrate", "measure_layout", "micro_benchmarks"]


def _matmul(n: int, dtype: str, device: str) -> float:
    import torch

    x = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    for _ in range(2):
        x @ x
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        x @ x
        reps += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _device_task(gpu: bool) -> dict:
    import torch

    device = "cuda" if gpu else "cpu"
    n = 4096 if gpu else 512
    fp32, bf16 = _matmul(n, "float32", device), _matmul(n, "bfloat16", device)
    a = torch.empty(64 * 2**20 // 4, device=device)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.3:
        a.clone()
        reps += 1
    bw = 2 * a.nbytes * reps / (time.perf_counter() - t0)
    return {"fp32": fp32, "bf16": bf16, "memory_bw": bw}


def _idle_rss_mb() -> float:
    import torch  # noqa: F401  (what every worker imports before it builds anything)
    import transformers  # noqa: F401

    import ray_disagg.worker.llm  # noqa: F401

    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:"))


def _allreduce_bw(rank: int, port: int, nbytes: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(t)
    seconds = (time.perf_counter() - t0) / 3
    dist.destroy_process_group()
    return 2 * 0.5 * nbytes / seconds  # ring all-reduce: 2 (n-1)/n of the bytes


def micro_benchmarks(cluster: Cluster) -> dict:
    """The micro-benchmarks (see the module docstring), in Ray tasks."""
    import socket

    import ray

    res = {"num_gpus": 1} if cluster.gpu else {"num_cpus": 1}
    dev = ray.get(ray.remote(**res)(_device_task).remote(cluster.gpu))
    idle = ray.get(ray.remote(num_cpus=1)(_idle_rss_mb).remote())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    task = ray.remote(num_cpus=1 if not cluster.gpu else 0)(_allreduce_bw)
    bw = min(ray.get([task.remote(r, port, 64 * 2**20) for r in range(2)]))
    return {**dev, "idle_mb": idle, "collective_bw": bw}


def measure_layout(recipe, steps: int, storage: str) -> dict:
    """Fit ``recipe`` (its groups, placement and loop) for ``steps`` steps on synthetic
    samples shaped like its workload; returns the median step time of the steps after
    the first two and each group's peak memory (MB, the last steps' maximum)."""
    from ray.train import RunConfig

    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.trainer import DisaggregatedTrainer, load_metrics

    cfg = recipe.model.load_config()
    loop = dataclasses.replace(
        recipe.loop, max_steps=steps, checkpoint_every=None, eval_every=None, lr=1e-4
    )
    data = synthetic_samples(cfg, 2 * loop.global_batch_size, grids=_grids(recipe, cfg))
    name = f"calibrate-{time.time_ns()}"
    result = DisaggregatedTrainer(
        model=recipe.model, groups=recipe.groups, train_loop_config=loop,
        datasets={"train": data}, placement=recipe.placement,
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()  # fmt: skip
    df = load_metrics(result).sort_values("step")
    tail = df[df["step"] > min(2, steps - 1)]
    out = {"step_s": float(statistics.median(tail["step_time_s"]))}
    for part in recipe.groups:
        out[f"{part}_peak_mb"] = float(tail[f"{part}_peak_memory_mb"].max())
    return out


def _grids(recipe, cfg) -> list:
    v = getattr(cfg, "vision_config", None)
    if v is None or not recipe.plan["images_per_sample"]:
        return [None]
    from ray_disagg.recipes.estimate import image_patches

    _, (h, w) = image_patches(v, recipe.plan["image_size"])
    return [{"images": [(1, h, w)] * recipe.plan["images_per_sample"]}]


def _terms(r, facts, work, c, f) -> tuple[float, float, float]:
    """``(a, b, c0)`` of ``step = a / F + b x overhead + c0`` for a sequential layout."""
    huge = dataclasses.replace(f, flops=dict.fromkeys(f.flops, 1e30), overhead_s=0.0)
    c0 = cost.predict(r, facts, work, c, huge).step_s
    unit = dataclasses.replace(huge, flops=dict.fromkeys(f.flops, 1.0))
    a = cost.predict(r, facts, work, c, unit).step_s - c0
    b = cost.predict(r, facts, work, c, dataclasses.replace(huge, overhead_s=1.0)).step_s - c0
    return a, b, c0


def reference_layouts(r, cluster: Cluster) -> list:
    """Tower 1 + LLM 1, separate, sequential, with 1 and 2 microbatches (the loop's
    precision), on one device each."""
    from ray_disagg.config import DataParallel
    from ray_disagg.recipes.planner import _group

    groups = {p: _group(g, 1, DataParallel(), False, cluster.gpu, 1) for p, g in r.groups.items()}
    k2 = 2 if r.loop.global_batch_size % 2 == 0 else 1
    return [
        cost.with_layout(r, groups=groups, placement="separate", micro_batches=k)
        for k in dict.fromkeys((1, k2))
    ]


def calibrate(r, cluster: Cluster, steps: int = 5, storage: str | None = None):
    """Measure :class:`DeviceFigures` for recipe ``r``'s model on the connected cluster
    (see the module docstring); returns ``(figures, runs)``."""
    import tempfile

    from ray_disagg.recipes.cluster import NOMINAL

    base = NOMINAL["gpu" if cluster.gpu else "cpu"]
    micro = micro_benchmarks(cluster)
    tiers = {t: micro["collective_bw"] for t in base.tier_bw}
    if not cluster.gpu:
        tiers["shm"] = micro["memory_bw"] / 2  # a copy in, a copy out
    figures = dataclasses.replace(
        base, name=f"calibrated {'GPU' if cluster.gpu else 'CPU core'}",
        collective_bw=micro["collective_bw"], inter_node_bw=micro["collective_bw"],
        tier_bw=tiers, memory_bw=micro["memory_bw"], calibrated=True,
    )  # fmt: skip
    storage = storage or tempfile.mkdtemp(prefix="ray_disagg_calibrate_")
    model = cost._Cached(r.model)
    r = dataclasses.replace(r, model=model)
    facts, work = cost.model_facts(r), cost.workload(r)
    runs, rows, ys = [], [], []
    for layout in reference_layouts(r, cluster):
        measured = measure_layout(layout, steps, storage)
        a, b, c0 = _terms(layout, facts, work, cluster, figures)
        rows.append((a, b))
        ys.append(measured["step_s"] - c0)
        runs.append((layout, measured))
    inv_flops, overhead = _solve(rows, ys)
    ratio = micro["bf16"] / micro["fp32"]
    figures.flops = {"float32": 1 / inv_flops, "bfloat16": ratio / inv_flops}
    figures.overhead_s = overhead
    figures.memory_scale = _memory_scale(runs[0], micro["idle_mb"])
    figures.idle_mb = micro["idle_mb"]
    return figures, runs


def _solve(rows, ys) -> tuple[float, float]:
    """``(1 / F, overhead)`` from ``y = a / F + b overhead`` (both kept positive)."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    if len(rows) == 1 or np.linalg.matrix_rank(a) < 2:
        return max(y[0], 1e-6) / a[0][0], 0.0
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    inv, overhead = float(x[0]), float(x[1])
    if inv <= 0 or overhead < 0:  # noise: all of it compute
        return max(float(y.mean()), 1e-6) / float(a[:, 0].mean()), 0.0
    return inv, overhead


def _memory_scale(run, idle_mb: float) -> dict:
    """Measured peak over the idle worker / the estimate, per kind of group."""
    from ray_disagg.recipes.estimate import estimate

    layout, measured = run
    llm = layout.model.adapter.llm_part
    est = estimate(layout)
    out = {}
    for part, m in est.items():
        peak = measured[f"{part}_peak_mb"] - idle_mb
        out["llm" if part == llm else "encoder"] = max(peak * 2**20, 1.0) / max(m.total, 1.0)
    return out
