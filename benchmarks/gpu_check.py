"""GPU check, one GPU: a colocated 1 vision + 1 text run (0.5 GPU each) whose tensors
cross over the CUDA IPC tier, against the single-process model (fp32: losses within 1e-4;
bf16 autocast: within 2%), then the bandwidth of each transfer tier available here.

    python benchmarks/gpu_check.py

Exits non-zero when a check fails. Needs CUDA (prints a line and exits 0 without it).
"""

import os
import sys
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOOP = {"max_steps": 4, "global_batch_size": 4, "lr": 1e-3, "eps": 1e-6, "seed": 3}


def colocated_run(spec, data, loop, storage, name):
    from ray.train import RunConfig, ScalingConfig

    from ray_disagg import DisaggregatedTrainer, ModuleGroup, load_metrics

    def half_gpu():
        sc = ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"GPU": 0.5})
        return ModuleGroup(scaling_config=sc)

    result = DisaggregatedTrainer(
        model=spec,
        groups={"vision": half_gpu(), "text": half_gpu()},
        train_loop_config=loop,
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=storage),
        placement="colocated",
    ).fit()
    return load_metrics(result), result.metrics


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked")
        return 0
    import ray

    from ray_disagg import HFModelSpec, TrainLoopConfig, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.testing.reference import reference_train

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=7)
    data = synthetic_samples(cfg, 8, grids=[(1, 4, 4), (1, 8, 4), None, (1, 8, 8)])
    ref, _, _ = reference_train(spec, data, TrainLoopConfig(**LOOP))  # CPU, fp32

    ray.init(num_cpus=4, num_gpus=1, _node_ip_address="127.0.0.1", include_dashboard=False)
    storage, failures = tempfile.mkdtemp(), []
    for name, loop, rtol in [("fp32", LOOP, 1e-4), ("bf16", dict(LOOP, bf16=True), 2e-2)]:
        df, last = colocated_run(spec, data, loop, storage, name)
        losses = df.sort_values("step")["loss"].tolist()
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        ok = err <= rtol and last["transfer_tier"] == "cuda_ipc"
        print(
            f"{name}: tier {last['transfer_tier']}, losses {[round(v, 5) for v in losses]} vs "
            f"reference {[round(v, 5) for v in ref]}: max rel err {err:.2e} "
            f"(limit {rtol:g}) {'OK' if ok else 'FAIL'}; step {last['mean_step_time_s']:.3f}s, "
            f"peak MB vision {last['vision_peak_memory_mb']:.0f} text "
            f"{last['text_peak_memory_mb']:.0f}"
        )
        if not ok:
            failures.append(name)
    ray.shutdown()

    import transfer

    sizes = [1, 16, 128]
    bw = transfer.bandwidth(sizes)
    print("\none-way bandwidth, GB/s")
    print(f"{'path':12s}" + "".join(f"{f'{s} MiB':>10s}" for s in sizes))
    for path in ["memcpy", "raw gloo", "gloo", "shm", "cuda_ipc", "nccl"]:
        if (path, sizes[0]) in bw:
            print(f"{path:12s}" + "".join(f"{bw[(path, s)]:10.2f}" for s in sizes))
    print("gpu_check:", "FAILED " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
