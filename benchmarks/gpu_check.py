"""GPU checks, each case in its own subprocess with a timeout (a deadlock prints FAIL, not
a hang), one ``PASS``/``FAIL``/``SKIP`` line per case, then a summary:

- ``cuda_ipc_fp32``: colocated 1 vision + 1 text (0.5 GPU each), tensors over the CUDA IPC
  tier, losses within 1e-4 of the single-process fp32 model;
- ``colocated_1f1b``: the same with the 1F1B schedule and ``micro_batches=4``, workers
  started with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue: stream ordering
  mistakes show up as deadlocks or wrong losses);
- ``bf16``: the colocated run under bf16 autocast, losses within 2%;
- ``nccl_separate`` and ``nccl_separate_1f1b``: separate placement, one GPU per worker,
  ``transfer='nccl'`` (SKIP with fewer than 2 GPUs);
- ``bandwidth``: one-way bandwidth of each transfer tier available here (informative).

    python benchmarks/gpu_check.py [--timeout 600]

Exits non-zero when a case fails. Needs CUDA (prints one line and exits 0 without it).
Ray runs on 127.0.0.1 only.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOOP = {"max_steps": 4, "global_batch_size": 4, "lr": 1e-3, "eps": 1e-6, "seed": 3}
PIPE = {"micro_batches": 4, "schedule": "1f1b"}
# name: (placement, transfer, loop overrides, relative tolerance, tier, GPUs, worker env)
CASES = {
    "cuda_ipc_fp32": ("colocated", "auto", {}, 1e-4, "cuda_ipc", 1, {}),
    "colocated_1f1b": (
        "colocated", "auto", PIPE, 1e-4, "cuda_ipc", 1, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    ),
    "bf16": ("colocated", "auto", {"bf16": True}, 2e-2, "cuda_ipc", 1, {}),
    "nccl_separate": ("separate", "nccl", {}, 1e-4, "nccl", 2, {}),
    "nccl_separate_1f1b": ("separate", "nccl", PIPE, 1e-4, "nccl", 2, {}),
}  # fmt: skip


def _groups(placement: str):
    from ray.train import ScalingConfig

    from ray_disagg import ModuleGroup

    share = {"GPU": 0.5} if placement == "colocated" else {"GPU": 1}
    sc = ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker=share)
    return {"vision": ModuleGroup(scaling_config=sc), "text": ModuleGroup(scaling_config=sc)}


def run_case(name: str) -> dict:
    """One case, in this process: a short run against the single-process reference."""
    import ray
    from ray.train import RunConfig

    from ray_disagg import (
        DisaggregatedTrainer,
        HFModelSpec,
        TrainLoopConfig,
        load_metrics,
        tiny_qwen2_5_vl_config,
    )
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.testing.reference import reference_train

    placement, transfer, extra, rtol, tier, _gpus, env = CASES[name]
    loop = dict(LOOP, **extra)
    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=7)
    data = synthetic_samples(cfg, 8, grids=[(1, 4, 4), (1, 8, 4), None, (1, 8, 8)])
    ref, _, _ = reference_train(spec, data, TrainLoopConfig(**LOOP))  # CPU, fp32
    ray.init(
        num_cpus=4,
        num_gpus=torch.cuda.device_count(),
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        runtime_env={"env_vars": env} if env else None,
    )
    try:
        result = DisaggregatedTrainer(
            model=spec,
            groups=_groups(placement),
            train_loop_config=loop,
            datasets={"train": data},
            run_config=RunConfig(name=name, storage_path=tempfile.mkdtemp()),
            placement=placement,
            transfer=transfer,
        ).fit()
    finally:
        ray.shutdown()
    losses = load_metrics(result).sort_values("step")["loss"].tolist()
    last = result.metrics
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    ok = len(losses) == len(ref) and err <= rtol and last["transfer_tier"] == tier
    detail = (
        f"tier {last['transfer_tier']} (want {tier}), max rel err {err:.2e} vs the "
        f"reference (limit {rtol:g}), step {last['mean_step_time_s']:.3f}s"
    )
    return {"status": "PASS" if ok else "FAIL", "detail": detail}


def run_bandwidth() -> dict:
    import transfer

    sizes = [1, 16, 128]
    bw = transfer.bandwidth(sizes)
    rows = [
        f"{path} " + " ".join(f"{bw[(path, s)]:.2f}" for s in sizes)
        for path in ["memcpy", "raw gloo", "gloo", "shm", "cuda_ipc", "nccl"]
        if (path, sizes[0]) in bw
    ]
    return {"status": "PASS", "detail": f"GB/s at {sizes} MiB: " + "; ".join(rows)}


def _child(name: str) -> None:
    try:
        out = run_bandwidth() if name == "bandwidth" else run_case(name)
    except BaseException as e:  # reported as FAIL by the parent
        out = {"status": "FAIL", "detail": f"{type(e).__name__}: {str(e)[:300]}"}
    print("GPU_CHECK_RESULT " + json.dumps(out), flush=True)


def _spawn(name: str, timeout_s: float) -> dict:
    """Run one case in a subprocess of its own session; kill the session on timeout."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"status": "FAIL", "detail": f"no result after {timeout_s:.0f}s (deadlock?)"}
    for line in reversed(out.splitlines()):
        if line.startswith("GPU_CHECK_RESULT "):
            return json.loads(line.removeprefix("GPU_CHECK_RESULT "))
    tail = " | ".join(out.strip().splitlines()[-3:])
    return {"status": "FAIL", "detail": f"exit code {proc.returncode} without a result: {tail}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    args = parser.parse_args()
    if args.case:
        _child(args.case)
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked")
        return 0
    gpus = torch.cuda.device_count()
    print(f"device: {torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}")
    results = {}
    for name in [*CASES, "bandwidth"]:
        need = CASES[name][5] if name in CASES else 1
        t0 = time.monotonic()
        if gpus < need:
            res = {"status": "SKIP", "detail": f"needs {need} GPUs, {gpus} here"}
        else:
            res = _spawn(name, args.timeout)
        results[name] = res["status"]
        print(f"{res['status']} {name} ({time.monotonic() - t0:.0f}s): {res['detail']}", flush=True)
    failed = [n for n, s in results.items() if s == "FAIL"]
    counts = {s: list(results.values()).count(s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {counts}" + (f"; FAILED {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
