"""Transfer bandwidth of each tier and the step time of colocated vs separate placement,
side by side, in one run.

Part 1 (two spawned processes on this node, tensors of 1, 16 and 128 MiB): a raw
``memcpy`` in one process, raw gloo send/recv, and every tier available here through
``Channel.send_tensors``: gloo and shm on CPU; cuda_ipc (both processes on GPU 0) and
nccl (GPUs 0 and 1) when CUDA is there. Each figure is one-way bandwidth from a
ping-pong (the receiver sends the tensor it got back), best of a few rounds.

Part 2 (a real Ray cluster on 127.0.0.1): mean step time of one vision + one text worker,
placed separately and colocated (one placement group), and separately over gloo.

    python benchmarks/transfer.py [--sizes 1 16 128] [--steps 8]
"""

import argparse
import functools
import multiprocessing as mp
import os
import tempfile
import time

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import torch  # noqa: E402

from ray_disagg.transport import channel as sg  # noqa: E402

ROUNDS = 5


def _pingpong(fn, rounds=ROUNDS) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) / 2)
    return best


def _roundtrip(side, x, device):
    side.send_tensors(1, {"x": x})
    _, got = side.recv_tensors(1, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_gloo(pg, x):
    pg.send([x], 1, 0).wait()
    pg.recv([x], 1, 0).wait()


def _two_copies(dst, src):
    dst.copy_(src)
    dst.copy_(src)


def _bench_worker(rank, port_q, result_q, sizes, tiers):
    torch.set_num_threads(1)
    store = None
    if rank == 0:
        store, port = sg.host_store("127.0.0.1", 120.0)
        port_q.put(port)
    else:
        port = port_q.get()
    out = {}
    for tier in tiers:
        device = torch.device("cpu")
        if tier in ("cuda_ipc", "nccl"):
            device = torch.device("cuda", rank if tier == "nccl" else 0)
            torch.cuda.set_device(device)
        spec = sg.ChannelSpec(
            "127.0.0.1", port, {"a": 0, "b": 1}, {"a": 1, "b": 1}, 120.0, f"bench/{tier}",
            tiers={(0, 1): tier},
        )  # fmt: skip
        side = sg.join(spec, rank, "127.0.0.1", store=store, device=device)
        for mib in sizes:
            x = torch.ones(mib * 2**18, device=device)
            if rank == 0:
                fn = functools.partial(_roundtrip, side, x, device)
                fn()  # warm-up: buffers, communicators
                out[(tier, mib)] = mib / 1024 / _pingpong(fn)
            else:
                for _ in range(ROUNDS + 1):
                    _, got = side.recv_tensors(0, device)
                    side.send_tensors(0, got)
                    del got
        if tier == "gloo":  # raw gloo and memcpy for reference
            for mib in sizes:
                x = torch.ones(mib * 2**18)
                if rank == 0:
                    fn = functools.partial(_raw_gloo, side.pg, x)
                    fn()
                    out[("raw gloo", mib)] = mib / 1024 / _pingpong(fn)
                    fn = functools.partial(_two_copies, torch.empty_like(x), x)
                    fn()
                    out[("memcpy", mib)] = mib / 1024 / _pingpong(fn)
                else:
                    for _ in range(ROUNDS + 1):
                        side.pg.recv([x], 0, 0).wait()
                        side.pg.send([x], 0, 0).wait()
        side.close()
    result_q.put((rank, out))


def bandwidth(sizes) -> dict:
    tiers = ["gloo", "shm"]
    if torch.cuda.is_available():
        tiers.append("cuda_ipc")
        if torch.cuda.device_count() >= 2:
            tiers.append("nccl")
    ctx = mp.get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_bench_worker, args=(r, port_q, result_q, sizes, tiers))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(result_q.get(timeout=900) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    return results[0]


def step_times(steps: int) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig

    from ray_disagg import (
        DisaggregatedTrainer,
        HFModelSpec,
        ModuleGroup,
        tiny_qwen2_5_vl_config,
    )
    from ray_disagg.data.examples import synthetic_samples

    cfg = tiny_qwen2_5_vl_config(
        text_hidden=128, text_layers=4, vision_hidden=64, vision_depth=4,
        fullatt_block_indexes=(1, 3),
    )  # fmt: skip
    spec = HFModelSpec(config=cfg, seed=0)
    data = synthetic_samples(cfg, 32, grids=[(1, 16, 16)])
    loop = {"max_steps": steps, "global_batch_size": 8, "shuffle": False}

    def g():
        return ModuleGroup(
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1})
        )

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    storage, rows = tempfile.mkdtemp(), {}
    for name, placement, transfer in [
        ("separate, gloo", "separate", "gloo"),
        ("separate, auto", "separate", "auto"),
        ("colocated, auto", "colocated", "auto"),
    ]:
        m = (
            DisaggregatedTrainer(
                model=spec,
                groups={"vision": g(), "text": g()},
                train_loop_config=loop,
                datasets={"train": data},
                run_config=RunConfig(name=name.replace(", ", "-"), storage_path=storage),
                placement=placement,
                transfer=transfer,
            )
            .fit()
            .metrics
        )
        rows[name] = (
            m["mean_step_time_s"],
            m["transfer_tier"],
            m["vision_wait_s"],
            m["text_wait_s"],
        )
    ray.shutdown()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 128], help="MiB")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()

    bw = bandwidth(args.sizes)
    paths = ["memcpy", "raw gloo"] + [
        t for t in ("gloo", "shm", "cuda_ipc", "nccl") if (t, args.sizes[0]) in bw
    ]
    print("\none-way bandwidth, GB/s (two processes on this node; memcpy: one process)\n")
    print(f"{'path':12s}" + "".join(f"{f'{s} MiB':>10s}" for s in args.sizes))
    for path in paths:
        print(f"{path:12s}" + "".join(f"{bw[(path, s)]:10.2f}" for s in args.sizes))
    print(
        f"{'shm / gloo':12s}"
        + "".join(f"{bw[('shm', s)] / bw[('gloo', s)]:9.1f}x" for s in args.sizes)
    )

    rows = step_times(args.steps)
    print(f"\n1 vision + 1 text worker, {args.steps} steps (CPU)\n")
    head = f"{'placement, transfer':22s} {'tier':>8s} {'step s':>8s}"
    print(head + f" {'vision wait s':>14s} {'text wait s':>12s}")
    for name, (step, tier, vw, tw) in rows.items():
        print(f"{name:22s} {tier:>8s} {step:8.3f} {vw:14.3f} {tw:12.3f}")


if __name__ == "__main__":
    main()
