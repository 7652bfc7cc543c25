"""Peak memory of each group next to what its shard of the training state needs, in one run.

For each layout (vision 1 + text 1 / text TP2 / text FSDP2 over 2 / text FSDP2 x TP2 over
4) it trains a Qwen2.5-VL with a ~300M-parameter LLM and a ~5M-parameter vision tower
(saved once in bf16 with ``save_pretrained`` under ``--cache`` and loaded through
``HFModelSpec(pretrained_path=...)``) for a few steps, fp32 parameters and AdamW, and
prints per group:

- ``peak``: the group's ``<group>_peak_memory_mb`` of the last step, i.e. the peak resident
  set size (``VmHWM``, reset once a step) of the group's **rank 0 only** from the previous
  step's reading (before its optimizer step) to the last step's, before its optimizer step
  (the AdamW state of the earlier steps is in it);
- ``base``: the same figure for a Ray Train worker that builds nothing (the runtime);
- ``(b)``: what this rank's shard of parameters + gradients + AdamW state needs,
  16 bytes/param in fp32, from the part's parameter counts on the ``meta`` device: FSDP2
  divides every tensor by its shard degree, TP every tensor but the norms (which stay
  whole on every TP rank, as the plan keeps them replicated); FSDP2 padding is ignored;
- ``(peak - base) / (b)`` next to the target (<= 1.5 vision, <= 1.3 text).

It prints the text group's rank-0 peak of every step and its growth from step 3 to the
last step (the heap must not grow step over step: at most 5% for 10 steps), the peak RSS
(``VmHWM``) of every Ray Train worker process of each run, polled from ``/proc`` every
0.25 s (all ranks, including the checkpoint written after the last step), and, unless
``--skip-big``, a "fits only when sharded" case: a ~0.9B LLM whose fp32 training state
for two unsharded replicas (2 x 16 x N bytes) exceeds 24 GiB, random init, trained 2
steps with text FSDP2 over 2 workers + vision 1. ``--tiny`` shrinks everything (a few-M
LLM) for a quick check; its ratios are dominated by allocator noise.

    python benchmarks/memory.py [--tiny] [--skip-big] [--steps 3] [--cache DIR]
        [--layouts 1,tp2,fsdp2,fsdp2xtp2,ep2] [--lora] [--dpo]

``--dpo`` adds the DPO rows (``benchmarks/dpo_rows.py``): the copy reference's extra peak
next to the text shard's parameter bytes, under text TP2 and text FSDP2.

``--lora`` adds the LoRA rows (``benchmarks/lora_rows.py``): text TP2 trained in full and
with LoRA r=16 on every linear of the LLM, the plan's estimate and the ratios.

The ``ep2`` row trains a Qwen3-VL-MoE of the same scale (~324M LLM parameters, 8 experts
of which each token takes 2, 226M of them in experts) with its experts split over 2
workers (``ExpertParallel(size=2)``; the dense weights whole on both): ``(b)`` divides
only the experts by 2.

e.g. ``--layouts fsdp2 --steps 10 --skip-big`` for the FSDP2 case's growth only.
"""

import argparse
import hashlib
import os
import shutil
import tempfile
import threading

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import psutil  # noqa: E402
import ray  # noqa: E402
import ray.train  # noqa: E402
import torch  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from ray_disagg import (  # noqa: E402
    DataParallel,
    DisaggregatedTrainer,
    ExpertParallel,
    HFModelSpec,
    ModuleGroup,
    TensorParallel,
    load_metrics,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl_moe_config,
)
from ray_disagg.data.examples import synthetic_samples  # noqa: E402

MB = 2**20
BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq
TARGET = {"vision": 1.5, "text": 1.3}
# LLM: vocab, hidden, layers, heads, KV heads, MLP width; vision tower: hidden, depth
SIZES = {  # text / vision parameters, counted on the meta device
    "300m": (32000, 1024, 20, 16, 4, 3072, 256, 4),  # 306.8M / 4.8M
    "big": (32000, 2048, 16, 16, 4, 6144, 256, 4),  # 902.9M / 5.8M
    "tiny": (4096, 256, 4, 4, 2, 512, 64, 2),  # 4.5M / 0.2M
}
LAYOUTS = {  # key: name, text workers, text parallelism, (tp, fsdp, ep) of a text shard
    "1": ("vision 1 + text 1", 1, "none", 1, 1, 1),
    "tp2": ("vision 1 + text TP2", 2, TensorParallel(size=2), 2, 1, 1),
    "fsdp2": ("vision 1 + text FSDP2 (2)", 2, DataParallel(fsdp=True), 1, 2, 1),
    "fsdp2xtp2": ("vision 1 + text FSDP2xTP2 (4)", 4, TensorParallel(size=2, fsdp=True), 2, 2, 1),
    # the MoE model (Qwen3-VL-MoE, MOE_SIZES): experts split over 2, dense weights whole
    "ep2": ("vision 1 + MoE text EP2", 2, ExpertParallel(size=2), 1, 1, 2),
}
# LLM: vocab, hidden, layers, heads, KV heads, experts, top-k, expert width; vision as SIZES
MOE_SIZES = {
    "300m": (32000, 1024, 12, 16, 4, 8, 2, 768, 256, 4),  # 323.6M (experts 226.5M) / 8.4M
    "tiny": (4096, 256, 4, 4, 2, 4, 2, 128, 64, 2),
}
GROWTH_FROM = 3  # first step of the growth check (the steps before allocate AdamW state)


def make_config(size: str):
    return config_from(SIZES[size])


def config_from(sizes: tuple):
    """A Qwen2.5-VL config from a ``SIZES``-shaped tuple."""
    vocab, hidden, layers, heads, kv, mlp, v_hidden, v_depth = sizes
    cfg = tiny_qwen2_5_vl_config(
        vocab_size=vocab,
        text_hidden=hidden,
        text_layers=layers,
        text_heads=heads,
        text_kv_heads=kv,
        vision_hidden=v_hidden,
        vision_depth=v_depth,
    )
    cfg.text_config.intermediate_size = mlp  # tiny_text_config sets 2 x hidden
    return cfg


def make_moe_config(size: str):
    vocab, hidden, layers, heads, kv, experts, k, width, v_hidden, v_depth = MOE_SIZES[size]
    return tiny_qwen3_vl_moe_config(
        vocab_size=vocab,
        text_hidden=hidden,
        text_layers=layers,
        text_heads=heads,
        text_kv_heads=kv,
        vision_hidden=v_hidden,
        vision_depth=v_depth,
        num_experts=experts,
        top_k=k,
        moe_intermediate_size=width,
        mlp_only_layers=(),
    )


def saved_model(cfg, size: str, cache: str) -> str:
    """A bf16 ``save_pretrained`` directory of the model (random init, seed 0), made once."""
    digest = hashlib.sha1(cfg.to_json_string().encode()).hexdigest()[:8]  # a changed config
    path = os.path.join(cache, f"{cfg.model_type}_{size}_{digest}_bf16")  # gets its own directory
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"saving {path} (once)")
        os.makedirs(cache, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache)  # renamed when complete
        HFModelSpec(config=cfg, seed=0).build_full().to(torch.bfloat16).save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


def shard_params(spec, part: str, tp: int = 1, fsdp: int = 1, ep: int = 1) -> float:
    """Parameters of one rank's shard of ``part`` (see the module docstring; expert
    parallelism divides the routed experts by ``ep``)."""
    return sum(
        p.numel() / (ep if ".experts." in name else fsdp * (1 if "norm" in name else tp))
        for name, p in spec.meta_model(part).named_parameters()
    )


class WorkerPeaks(threading.Thread):
    """Peak RSS (``VmHWM``, MB) of every Ray Train worker process started by this driver's
    Ray instance (its descendants), polled while a run is in flight."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks, self.done = {}, threading.Event()

    def run(self):
        while not self.done.wait(0.25):
            for proc in psutil.Process().children(recursive=True):
                try:
                    if "RayTrainWorker" not in " ".join(proc.cmdline()):
                        continue
                    with open(f"/proc/{proc.pid}/status") as f:
                        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
                except (psutil.Error, OSError, StopIteration, ValueError):
                    continue  # exited meanwhile
                self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0.0), hwm / 1024)


def fit(trainer):
    """``trainer.fit()`` and the sorted peaks of its worker processes."""
    watch = WorkerPeaks()
    watch.start()
    try:
        result = trainer.fit()
    finally:
        watch.done.set()
        watch.join()
    return result, sorted(watch.peaks.values(), reverse=True)


def _baseline_worker(_config):
    """The runtime alone: a Ray Train worker process (as every group's worker is) with
    torch, transformers, the HF model classes and ray_disagg's loops imported and the gloo
    process group (world size 1) that TorchTrainer sets up; it builds no model."""
    import resource

    import torch.distributed as dist

    import ray_disagg.models  # noqa: F401 - the transformers model classes
    import ray_disagg.worker.encoder  # noqa: F401
    import ray_disagg.worker.llm  # noqa: F401

    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with tempfile.TemporaryDirectory() as d:  # Result.metrics keeps checkpointed reports only
        with open(os.path.join(d, "peak"), "w") as f:
            f.write(str(peak))
        ray.train.report({"peak_mb": peak}, checkpoint=ray.train.Checkpoint.from_directory(d))


def group(n: int, parallelism="none") -> ModuleGroup:
    return ModuleGroup(
        scaling_config=ScalingConfig(num_workers=n, resources_per_worker={"CPU": 0.5}),
        parallelism=parallelism,
    )


def run_layout(spec, data, loop: dict, text: ModuleGroup, storage: str, name: str):
    """Peaks of the last reported step (``{group: MB}``), the text group's peak of every
    step (``[MB]``) and the peaks of every worker process."""
    result, procs = fit(
        DisaggregatedTrainer(
            model=spec,
            groups={"vision": group(1), "text": text},
            train_loop_config=loop,
            datasets={"train": data},
            run_config=RunConfig(name=name, storage_path=storage),
        )
    )
    metrics = load_metrics(result)
    last = metrics.iloc[-1]
    shutil.rmtree(result.path, ignore_errors=True)  # the checkpoint: up to GBs
    steps = [float(x) for x in metrics["text_peak_memory_mb"]]
    return {g: float(last[f"{g}_peak_memory_mb"]) for g in ("vision", "text")}, steps, procs


def fmt_procs(procs) -> str:
    return ", ".join(f"{p:.0f}" for p in procs) + f" (sum {sum(procs):.0f})" if procs else "n/a"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true", help="a few-M LLM, for a quick check")
    p.add_argument("--skip-big", action="store_true", help="skip the ~0.9B FSDP2 case")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cache", default="/tmp/ray_disagg_bench", help="saved model directory")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated keys")
    p.add_argument("--lora", action="store_true", help="also the LoRA rows (lora_rows.py)")
    p.add_argument("--dpo", action="store_true", help="also the DPO rows (dpo_rows.py)")
    args = p.parse_args()
    keys = [k for k in args.layouts.split(",") if k in LAYOUTS]  # "none": the LoRA rows only
    layouts = [LAYOUTS[k] for k in keys]

    size = "tiny" if args.tiny else "300m"
    cfg = make_config(size)
    spec = HFModelSpec(pretrained_path=saved_model(cfg, size, args.cache))
    data = synthetic_samples(cfg, 2 * args.steps, grids=[(1, 8, 8)])
    loop = {"max_steps": args.steps, "global_batch_size": 2, "shuffle": False}
    total = {part: shard_params(spec, part) for part in ("vision", "text")}
    moe = None  # (spec, data) of the MoE model, saved when an MoE layout runs
    if any(LAYOUTS[k][5] > 1 for k in keys):
        moe_cfg = make_moe_config(size)
        moe_spec = HFModelSpec(pretrained_path=saved_model(moe_cfg, size, args.cache))
        moe = moe_spec, synthetic_samples(moe_cfg, 2 * args.steps, grids=[(1, 8, 8)])
        n_moe = shard_params(moe_spec, "text")
        print(f"MoE Qwen3-VL-MoE ({size}): LLM {n_moe / 1e6:.1f}M params, EP rows train it")
    tokens = sum(len(s["input_ids"]) for s in data[:2])
    print(
        f"\nQwen2.5-VL ({size}): LLM {total['text'] / 1e6:.1f}M params, vision tower "
        f"{total['vision'] / 1e6:.2f}M params, from bf16 weights in {spec.pretrained_path}\n"
        f"training fp32 + AdamW, {args.steps} steps, global batch 2 ({tokens} tokens, "
        f"2 images of 8x8 patches)"
    )

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="ray_disagg_memory_")
    try:
        result, base_procs = fit(
            TorchTrainer(
                _baseline_worker,
                scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
                run_config=RunConfig(name="baseline", storage_path=storage),
            )
        )
        base = float(result.metrics["peak_mb"])
        runs = []
        for name, n_text, parallelism, tp, fsdp, ep in layouts:
            text = group(n_text, parallelism)
            s, d = (spec, data) if ep == 1 else moe
            peaks, steps, procs = run_layout(s, d, loop, text, storage, name)
            b = {"vision": shard_params(s, "vision"), "text": shard_params(s, "text", tp, fsdp, ep)}
            b = {g: n * BYTES_PER_PARAM / MB for g, n in b.items()}
            runs.append((name, peaks, b, procs, steps))
        big = None if args.skip_big else run_big(args, storage)
        if args.lora:
            from lora_rows import lora_rows

            lora_rows(spec, data, loop, storage, base, group, fit)
        if args.dpo:
            from dpo_rows import dpo_rows

            dpo_rows(spec, cfg, loop, storage, group, fit, shard_params)
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)

    print(
        f"\nbaseline (Ray Train worker, nothing built): {base:.0f} MB "
        f"(worker process VmHWM: {fmt_procs(base_procs)})\n"
        "peak = VmHWM (one step's) of the group's rank 0 only; (b) = its shard of params + grads + "
        "AdamW state, 16 B/param (TP: norms whole)\n"
    )
    head = f"{'layout':31s} {'group':6s} {'peak':>7s} {'base':>6s} {'peak-base':>9s}"
    print(f"{head} {'(b)':>7s} {'ratio':>6s} {'target':>6s}")
    for name, peaks, b, _, _ in runs:
        for g in ("vision", "text"):
            extra = peaks[g] - base
            print(
                f"{name if g == 'vision' else '':31s} {g:6s} {peaks[g]:7.0f} {base:6.0f} "
                f"{extra:9.0f} {b[g]:7.0f} {extra / b[g]:6.2f} {'<= ' + str(TARGET[g]):>6s}"
            )
    print("\n(MB = 2^20 bytes)\nevery Ray Train worker process's peak RSS (VmHWM, polled, MB):")
    for name, _, _, procs, _ in runs:
        print(f"  {name:31s} {fmt_procs(procs)}")
    print("\ntext rank 0 peak RSS of each step (VmHWM, reset every step, MB):")
    for name, _, _, _, steps in runs:
        growth = ""
        if len(steps) > GROWTH_FROM:
            first, last = steps[GROWTH_FROM - 1], steps[-1]
            growth = (
                f"; step {GROWTH_FROM} -> {len(steps)}: {last - first:+.0f} MB "
                f"({100 * (last / first - 1):+.1f}%)"
            )
        print(f"  {name:31s} {', '.join(f'{x:.0f}' for x in steps)}{growth}")
    if big is not None:
        print_big(*big)


def run_big(args, storage: str):
    """The LLM that fits only when sharded: random init (no save), text FSDP2 over 2."""
    cfg = make_config("tiny" if args.tiny else "big")
    spec = HFModelSpec(config=cfg, seed=0)
    data = synthetic_samples(cfg, 4, grids=[(1, 8, 8)])
    loop = {"max_steps": 2, "global_batch_size": 2, "shuffle": False}
    text = group(2, DataParallel(fsdp=True))
    peaks, _, procs = run_layout(spec, data, loop, text, storage, "fits-only-sharded")
    return shard_params(spec, "text"), shard_params(spec, "vision"), peaks, procs


def print_big(n_text, n_vision, peaks, procs):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ddp = 2 * BYTES_PER_PARAM * n_text
    print(
        f"\nfits only when sharded: LLM {n_text / 1e9:.3f}B params (vision "
        f"{n_vision / 1e6:.1f}M), random init, text FSDP2 over 2 + vision 1, 2 steps\n"
        f"  DDP estimate, two unsharded text replicas (2 x 16 B x N): {ddp / MB:8.0f} MB\n"
        f"  machine RAM (os.sysconf):                                {ram / MB:8.0f} MB\n"
        f"  (b) per text worker (16 B x N / 2):                      "
        f"{BYTES_PER_PARAM * n_text / 2 / MB:8.0f} MB\n"
        f"  text rank 0 peak (text_peak_memory_mb):                  {peaks['text']:8.0f} MB\n"
        f"  vision peak (vision_peak_memory_mb):                     {peaks['vision']:8.0f} MB\n"
        f"  every worker process's peak (VmHWM; the two text workers are the largest): "
        f"{fmt_procs(procs)}"
    )


if __name__ == "__main__":
    main()
