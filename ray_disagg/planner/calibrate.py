"""``ray-disagg plan --auto --calibrate``: measure the device figures of the connected Ray
cluster for the planner's cost model (:mod:`ray_disagg.planner.cost`).

1. Micro-benchmarks, each in a Ray task of one device: the bf16/fp32 matmul speed ratio,
   the memory bandwidth (a large copy), a gloo all-reduce between two workers of one
   node (the collective and transfer bandwidths) and an idle worker's resident memory.
2. Seven short runs of the recipe's model on synthetic samples shaped like its workload
   (separate, sequential; :func:`reference_layouts`): tower 1 + LLM 1 with 1 and 2
   microbatches give the achieved FLOP/s (the tower's relative to the LLM's from their
   compute seconds: ``encoder_speed``) and how compute per sample changes with the
   microbatch size (``microbatch_exponent``); the LLM data parallel over 2 the bandwidth
   of the gradient sync as a step runs it (``grad_sync_bw``); bf16 autocast its FLOP/s
   (casts included; the micro-benchmark's bf16/fp32 ratio until then); the LLM TP2 the
   seconds per collective call; the LLM FSDP2 over 2 the seconds per FSDP2 unit and pass
   beyond its collectives (``fsdp_unit_s``). Each of these runs also pays the other
   figures' terms, so they are fitted in turn until they settle. With activation
   checkpointing, the one-microbatch runs' peak memory over the idle worker's fits each
   kind of group's fixed bytes and activation scale.

On a 2-core CPU machine it takes a few minutes; the figures go to a JSON file that later
``plan --auto`` runs read (``--figures``; default ``~/.cache/ray_disagg/``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import numpy as np

from ray_disagg.planner import cost
from ray_disagg.planner.cluster import Cluster
from ray_disagg.planner.memory import worker_terms

__all__ = [
    "bisect_figure",
    "calibrate",
    "fit_encoder_speed",
    "fit_figures",
    "fit_per_unit",
    "measure_layout",
    "micro_benchmarks",
    "step_terms",
]


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


def samples(recipe) -> list[dict]:
    """Synthetic samples shaped like the recipe's plan (its images, a short caption)."""
    from ray_disagg.data.examples import synthetic_samples

    cfg = recipe.model.load_config()
    return synthetic_samples(cfg, 2 * recipe.loop.global_batch_size, grids=_grids(recipe, cfg))


def sample_workload(recipe, data: list[dict]) -> tuple[object, cost.Workload]:
    """``(recipe, workload)`` of ``data``: the recipe's plan set to its token count."""
    tokens = float(np.mean([len(s["input_ids"]) for s in data]))
    patches = float(np.mean([len(s.get("pixel_values", ())) for s in data]))
    images = float(np.mean([len(s.get("image_grid_thw", ())) for s in data]))
    recipe = dataclasses.replace(recipe, plan={**recipe.plan, "seq_len": round(tokens)})
    return recipe, cost.Workload(tokens, patches, images, f"{len(data)} synthetic samples")


def measure_layout(recipe, steps: int, storage: str, data: list[dict] | None = None) -> dict:
    """Fit ``recipe`` (its groups, placement and loop) for ``steps`` steps on ``data``
    (default :func:`samples`); returns the step time (the median of the faster half of
    the steps after the first two), each group's median compute seconds and its peak
    memory (MB, the last steps' maximum)."""
    from ray.train import RunConfig

    from ray_disagg.run_files import load_metrics
    from ray_disagg.trainer import DisaggregatedTrainer

    loop = dataclasses.replace(
        recipe.loop, max_steps=steps, checkpoint_every=None, eval_every=None, lr=1e-4
    )
    data = samples(recipe) if data is None else data
    name = f"calibrate-{time.time_ns()}"
    result = DisaggregatedTrainer(
        model=getattr(recipe.model, "spec", recipe.model), groups=recipe.groups,
        train_loop_config=loop,
        datasets={"train": data}, placement=recipe.placement,
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()  # fmt: skip
    df = load_metrics(result).sort_values("step")
    tail = df[df["step"] > min(2, steps - 1)]
    # the faster half: interference from other processes on the cores only slows a step
    fast = sorted(tail["step_time_s"])[: max(1, (len(tail) + 1) // 2)]
    out = {"step_s": float(statistics.median(fast))}
    for part in recipe.groups:
        out[f"{part}_peak_mb"] = float(tail[f"{part}_peak_memory_mb"].max())
        out[f"{part}_compute_s"] = float(statistics.median(tail[f"{part}_compute_s"]))
    return out


def _grids(recipe, cfg) -> list:
    v = getattr(cfg, "vision_config", None)
    if v is None or not recipe.plan["images_per_sample"]:
        return [None]
    _, (h, w) = recipe.model.adapter.image_patches(recipe.plan["image_size"])
    return [{"images": [(1, h, w)] * recipe.plan["images_per_sample"]}]


def step_terms(r, facts, work, c, f) -> tuple[float, float, float]:
    """``(a, b, c0)`` of ``step = a / F + b x overhead + c0`` for a sequential layout."""
    huge = dataclasses.replace(f, flops=dict.fromkeys(f.flops, 1e30), overhead_s=0.0)
    c0 = cost.predict(r, facts, work, c, huge).step_s
    unit = dataclasses.replace(huge, flops=dict.fromkeys(f.flops, 1.0))
    a = cost.predict(r, facts, work, c, unit).step_s - c0
    b = cost.predict(r, facts, work, c, dataclasses.replace(huge, overhead_s=1.0)).step_s - c0
    return a, b, c0


def reference_layouts(r, cluster: Cluster) -> list:
    """Tower 1 + LLM 1 (separate, sequential) with 1 and 2 microbatches; tower 1 + LLM
    data parallel over 2; tower 1 + LLM 1 with activation checkpointing, and with bf16
    autocast; tower 1 + LLM TP2 when the heads split (one device each)."""
    from ray_disagg.config.groups import DataParallel, TensorParallel
    from ray_disagg.planner.search import group_for

    llm = r.model.adapter.llm_part
    t = r.model.load_config().text_config

    def at(n: int, parallelism, k: int = 1, ac: bool = False):
        groups = {}
        for p, g in r.groups.items():
            mine = (n, parallelism) if p == llm else (1, DataParallel())
            groups[p] = group_for(g, *mine, ac, cluster.gpu, 1)
        return cost.with_layout(
            r, groups=groups, placement="separate", micro_batches=k, schedule="sequential"
        )

    out = [at(1, DataParallel(), 1), at(1, DataParallel(), 2), at(2, DataParallel())]
    out.append(at(1, DataParallel(), ac=True))
    out.append(cost.with_layout(out[0], bf16=True))
    if t.num_attention_heads % 2 == 0 and t.num_key_value_heads % 2 == 0:
        out.append(at(2, TensorParallel(size=2)))
    out.append(at(2, DataParallel(fsdp=True)))
    return out


def calibrate(r, cluster: Cluster, steps: int = 5, storage: str | None = None):
    """Measure :class:`DeviceFigures` for recipe ``r``'s model on the connected cluster
    (see the module docstring); returns ``(figures, runs)``."""
    import tempfile

    micro = micro_benchmarks(cluster)
    storage = storage or tempfile.mkdtemp(prefix="ray_disagg_calibrate_")
    r = dataclasses.replace(r, model=cost.CachedModel(r.model))
    data = samples(r)
    r, work = sample_workload(r, data)
    runs = [(x, measure_layout(x, steps, storage, data)) for x in reference_layouts(r, cluster)]
    return fit_figures(r, cluster, micro, runs, work), runs


def fit_figures(r, cluster: Cluster, micro: dict, runs: list, work: cost.Workload):
    """The device figures that make the cost model reproduce ``runs`` (the
    :func:`reference_layouts` of ``r`` with their measurements) and the micro-benchmarks
    ``micro`` (:func:`micro_benchmarks`)."""
    from ray_disagg.planner.cluster import NOMINAL

    base = NOMINAL["gpu" if cluster.gpu else "cpu"]
    tiers = {t: micro["collective_bw"] for t in base.tier_bw}
    if not cluster.gpu:
        tiers["shm"] = micro["memory_bw"] / 2  # a copy in, a copy out
    f = dataclasses.replace(
        base, name=f"calibrated {'GPU' if cluster.gpu else 'CPU core'}",
        collective_bw=micro["collective_bw"], inter_node_bw=micro["collective_bw"],
        tier_bw=tiers, memory_bw=micro["memory_bw"], calibrated=True,
        collective_latency_s=0.0, idle_mb=micro["idle_mb"],
        overhead_s=0.0,
    )  # fmt: skip
    facts = cost.model_facts(r)
    ratio = micro["bf16"] / micro["fp32"]
    one, got1 = runs[0]  # one busy worker, no collective
    f.encoder_speed = fit_encoder_speed(one, got1, facts, work, cluster, f)
    a, _, c0 = step_terms(one, facts, work, cluster, f)
    inv_flops = max(got1["step_s"] - c0, 1e-6) / a
    f.flops = {"float32": 1 / inv_flops, "bfloat16": ratio / inv_flops}
    f.reference_samples = one.loop.global_batch_size / one.loop.micro_batches
    # the same layout at half the microbatch; then the LLM over both cores
    for _ in range(8):  # each figure's run also pays the others' terms: to a fixed point
        f.microbatch_exponent = bisect_figure(
            runs[1], facts, work, cluster, f, "microbatch_exponent", 0.5, 2.0
        )
        f.grad_sync_bw = bisect_figure(  # 1 MB/s to the micro-benchmark's bandwidth
            runs[2], facts, work, cluster, f, "grad_sync_bw", 1e6, f.collective_bw, log=True
        )
        f.flops["bfloat16"] = _bf16_flops(runs[4], facts, work, cluster, f)
        if len(runs) > 6:  # the TP2 run
            latency = fit_per_unit(runs[5], facts, work, cluster, f, "collective_latency_s")
            f.collective_latency_s = latency
        f.fsdp_unit_s = fit_per_unit(runs[-1], facts, work, cluster, f, "fsdp_unit_s")
    # one microbatch, no data-parallel buffer: the peak is the state + fixed + activations
    f.memory_fit = _memory_fit([runs[0], runs[3], *runs[5:-1]], micro["idle_mb"])
    return f


def bisect_figure(
    run, facts, work, cluster, f, name: str, lo: float, hi: float, log: bool = False
) -> float:
    """The value of figure ``name`` in ``[lo, hi]`` that makes the prediction of ``run``
    its measurement (a larger value predicts a shorter step: a higher microbatch
    exponent, a higher bandwidth), ``hi`` when even that predicts too long a step;
    ``log``: bisected on the logarithm (figures spanning orders of magnitude)."""
    layout, got = run
    to, back = (math.log, math.exp) if log else (float, float)
    lo, hi = to(lo), to(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        g = dataclasses.replace(f, **{name: back(mid)})
        if cost.predict(layout, facts, work, cluster, g).step_s > got["step_s"]:
            lo = mid
        else:
            hi = mid
    return back((lo + hi) / 2)


def fit_encoder_speed(layout, got, facts, work, cluster, f) -> float:
    """The encoders' FLOP/s relative to the LLM's: the predicted ratio of their compute
    seconds over the measured one (mean over the encoders), in the same run."""
    pred = cost.predict(layout, facts, work, cluster, f).compute_s
    llm = facts.llm_part
    ratios = [
        (pred[p] / pred[llm]) / (got[f"{p}_compute_s"] / got[f"{llm}_compute_s"])
        for p in pred
        if p != llm and got[f"{p}_compute_s"] > 0 and pred[llm] > 0
    ]
    return float(np.mean(ratios)) if ratios else 1.0


def _bf16_flops(run, facts, work, cluster, f) -> float:
    """bf16 autocast's achieved FLOP/s from its run (casts included)."""
    layout, got = run
    a, b, c0 = step_terms(layout, facts, work, cluster, f)
    spare = got["step_s"] - c0 - b * f.overhead_s
    return a / spare if spare > 0 else f.flops["bfloat16"]


def fit_per_unit(run, facts, work, cluster, f, name: str) -> float:
    """The seconds per call of figure ``name`` (collective calls, FSDP2 units) that make
    the prediction of ``run`` its measurement."""
    layout, got = run
    p0 = cost.predict(layout, facts, work, cluster, dataclasses.replace(f, **{name: 0.0})).step_s
    p1 = cost.predict(layout, facts, work, cluster, dataclasses.replace(f, **{name: 1.0}))
    per_call = p1.step_s - p0
    return max(0.0, (got["step_s"] - p0) / per_call) if per_call > 0 else 0.0


def _memory_fit(runs, idle_mb: float) -> dict:
    """Per kind of group, ``[fixed bytes, activation scale]`` fitted (least squares)
    to each run's peak over the idle worker less the state (runs without buffers)."""
    xs: dict[str, list] = {"llm": [], "encoder": []}
    ys: dict[str, list] = {"llm": [], "encoder": []}
    for layout, got in runs:
        llm = layout.model.adapter.llm_part
        for part in layout.groups:
            state, _, act = worker_terms(layout, part)
            kind = "llm" if part == llm else "encoder"
            xs[kind].append(act)
            ys[kind].append((got[f"{part}_peak_mb"] - idle_mb) * 2**20 - state)
    out = {}
    for kind in xs:
        x, y = np.asarray(xs[kind]), np.asarray(ys[kind])
        if len(x) < 2 or np.ptp(x) == 0:
            out[kind] = [float(max(y.mean(), 0.0)) if len(y) else 0.0, 0.0]
            continue
        scale, fixed = np.polyfit(x, y, 1)
        if scale < 0:
            scale, fixed = 0.0, float(y.mean())
        out[kind] = [float(max(fixed, 0.0)), float(scale)]
    return out
