"""Run a function on N real gloo processes (tier-2 tests)."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

from ray_disagg.testing.local import process_context


def _entry(fn, rank, world, init_file, queue, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        # plain pickle: torch tensors would otherwise travel as shared memory handles
        queue.put((rank, pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        queue.put((rank, pickle.dumps(RuntimeError(traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` fresh processes (forked from a preloaded
    server); returns results by rank."""
    ctx = process_context()
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "pg")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, init_file, queue, args), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        results = {
            r: pickle.loads(b) for r, b in (queue.get(timeout=timeout) for _ in range(world))
        }
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [
        f"rank {r}: {results[r]}" for r in range(world) if isinstance(results[r], BaseException)
    ]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
