"""A Ray-free runner of a ``DisaggregatedTrainer``'s groups, for the numerics tier.

Every worker is a process forked from one server process that imported torch and
transformers once (a Ray worker spends ~11 s of CPU importing them); each group gets
its own gloo default process group and device mesh, the channel between groups is the
real one (shared-memory and gloo tiers), and each worker runs the very loop Ray Train
would run, with a :class:`LocalSession` in place of Ray Train: reports and checkpoints go
to the run directory, and the result is a ``ray.train.Result`` built from them.

What it does not do is Ray's part: restarts, placement, Ray Data, callbacks. Tests of
those run on a real cluster.

Example:
    >>> from ray_disagg.testing.local import fit_local
    >>> result = fit_local(trainer)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import time
import traceback
from datetime import timedelta

import torch

__all__ = ["CHANNELS", "LocalSession", "fit_local", "process_context"]

CHANNELS = "channels.json"
"""In a local run's directory: each worker's cross-group process groups (``{"gloo": n,
"nccl": m, "peers": [side ranks]}`` by ``"<group> <rank>"``), for tests that count them."""

# Imported once by the fork server, inherited by every child.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "transformers.modeling_utils",
    "ray_disagg.launch.backend",  # each child unpickles its group's backend config
    "ray_disagg.worker.llm",
    "ray_disagg.worker.encoder",
]
_CTX = None


def process_context():
    """The multiprocessing context of the numerics tier: children forked from one
    preloaded server (a plain fork of a process that ran OpenMP is unsafe; a spawn
    imports everything again)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


class LocalSession:
    """The worker session of a local run: CPU, one node, reports into ``run_dir``."""

    def __init__(self, run_dir: str, reports=None):
        self.run_dir, self.reports = run_dir, reports

    def device(self) -> torch.device:
        return torch.device("cpu")

    def node_id(self) -> str:
        return "local"

    def node_ip(self) -> str:
        return "127.0.0.1"

    def placement(self):
        return None, None

    def fetch(self, ref):
        return pickle.loads(ref)  # the parent pickled it once (no tensor fds to pass)

    def run_tasks(self, fn, calls: list[tuple], timeout_s: float) -> list:
        """In this process, one after the other (a local run has no cluster)."""
        return [fn(*args) for args in calls]

    def report(self, metrics: dict, checkpoint_dir=None, name=None, async_upload=False):
        if checkpoint_dir is not None:  # every rank adds its files, as Ray Train's upload
            if name is None:
                raise ValueError("a local checkpoint needs its directory name")
            shutil.copytree(checkpoint_dir, os.path.join(self.run_dir, name), dirs_exist_ok=True)
            if async_upload:  # as Ray Train's delete_local_checkpoint_after_upload
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
        if self.reports is not None:
            self.reports.put(("report", dict(metrics), name if checkpoint_dir else None))

    def restart_checkpoint(self):
        return None

    def wait_reports(self, timeout_s: float) -> None:
        pass


def _worker(loop, backend, name, rank, spec, env, run_dir, messages, lead) -> None:
    import faulthandler

    import torch.distributed as dist

    from ray_disagg.worker import runtime, session
    from ray_disagg.worker.drill_env import FAULT_DRILL_ENV

    faulthandler.enable()
    os.environ.pop(FAULT_DRILL_ENV, None)  # the fork server's environment is not the run's
    os.environ.update(env)
    torch.set_num_threads(1)
    session.set_session(LocalSession(run_dir, messages if lead else None))
    try:
        timeout = timedelta(seconds=backend.timeout_s)
        store = dist.TCPStore(spec.master_addr, spec.master_port, None, False, timeout)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"group/{name}", store),
            rank=rank,
            world_size=backend.world_size,
            timeout=timeout,
        )
        runtime.init_runtime(
            backend.module, backend.mesh_shape, backend.mesh_axes, backend.timeout_s
        )
        runtime.join_channel(spec, name, rank)
        loop()
        channel = runtime.get_runtime().channel
        made = None if channel is None else {**channel.made, "peers": channel.peers}
        runtime.close_channel()
        messages.put(("done", name, rank, made))
    except BaseException:
        runtime.close_channel(abort=True)
        messages.put(("error", f"{name} group rank {rank}", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _channel_spec(trainer, sizes: dict[str, int], timeout_s: float):
    from ray_disagg.transport import channel as sg
    from ray_disagg.transport.select import Location, group_offsets, pair_tiers

    offsets = group_offsets(sizes)
    where = [Location(node="local", pid=i, device="cpu") for i in range(sum(sizes.values()))]
    tiers = pair_tiers(offsets, trainer.transfer_pairs(), where, trainer.transfer)
    store, port = sg.host_store("127.0.0.1", timeout_s)
    spec = sg.ChannelSpec("127.0.0.1", port, offsets, sizes, timeout_s, "side/local", where, tiers)
    return store, spec


def fit_local(trainer, timeout_s: float = 600.0):
    """Run ``trainer`` (a constructed ``DisaggregatedTrainer``) without Ray; returns a
    ``ray.train.Result`` (the latest checkpoint and its metrics, every checkpoint,
    ``metrics_dataframe``). Raises ``RuntimeError`` naming the group and rank of a failed
    worker."""
    from ray_disagg.worker.ingest import is_ray_dataset

    if is_ray_dataset(trainer.train_data):
        raise ValueError("fit_local reads map-style datasets only; Ray Data needs Ray.")
    run_dir = trainer.run_dir().local_path  # where the workers' traces go too
    if run_dir is None:
        raise ValueError("fit_local keeps its run on local storage: give a local storage_path.")
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        raise ValueError(f"fit_local starts runs from scratch: {run_dir} is not empty.")
    os.makedirs(run_dir, exist_ok=True)
    loops = trainer.group_loops(trainer.loop_args(put=pickle.dumps))
    sizes = {name: trainer.groups[name].num_workers for name in loops}
    store, spec = _channel_spec(trainer, sizes, trainer.loop_config.collective_timeout_s)
    env = trainer.worker_env_vars()
    ctx = process_context()
    messages = ctx.SimpleQueue()  # put() writes at once: no message is lost to a kill
    procs, reports, channels = {}, [], {}
    try:
        for i, (name, (loop, backend)) in enumerate(loops.items()):
            for rank in range(sizes[name]):
                lead = i == 0 and rank == 0  # the union's rank 0: the LLM group's
                args = (loop, backend, name, rank, spec, env, run_dir, messages, lead)
                procs[(name, rank)] = p = ctx.Process(target=_worker, args=args, daemon=True)
                p.start()
        _collect(messages, procs, timeout_s, reports, channels)
        with open(os.path.join(run_dir, CHANNELS), "w") as f:
            json.dump(channels, f, indent=1)
    finally:
        _keep_history(run_dir, reports)
        for p in procs.values():
            if p.is_alive():
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    return _result(run_dir, reports)


def _keep_history(run_dir: str, reports: list) -> None:
    """The run's metrics history from the union rank 0's reports, as the driver keeps it
    (``ray_disagg.run_files``), however the run ended."""
    from ray_disagg.launch.step_feed import StepFeed
    from ray_disagg.run_files import MetricsHistory, RunDir

    feed, history = StepFeed(), MetricsHistory(RunDir.of(run_dir))
    for metrics, name in reports:
        feed.add(metrics, checkpoint=name is not None)
    for metrics in feed.since(0):
        history.add(metrics)
    history.close()


def _collect(messages, procs: dict, timeout_s: float, reports: list, channels: dict) -> None:
    """Wait for every worker, putting the union rank 0's reports into ``reports`` and each
    worker's cross-group process groups and peers into ``channels``."""
    done, deadline = set(), time.monotonic() + timeout_s
    while len(done) < len(procs):
        if messages.empty():
            if time.monotonic() > deadline:
                _kill(procs)
                raise TimeoutError(f"local run did not finish within {timeout_s:g}s")
            dead = [k for k, p in procs.items() if p.exitcode not in (None, 0) and k not in done]
            if dead and messages.empty():
                _kill(procs)
                name, rank = dead[0]
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"{name} group rank {rank} died (exit code {code})")
            time.sleep(0.05)
            continue
        msg = messages.get()
        if msg[0] == "report":
            reports.append(msg[1:])
        elif msg[0] == "done":
            done.add((msg[1], msg[2]))
            channels[f"{msg[1]} {msg[2]}"] = msg[3]
        else:
            errors = [f"[{msg[1]} failed]:\n{msg[2]}"]
            time.sleep(1.0)  # the other workers' errors, if any, follow the first one's
            while not messages.empty():
                more = messages.get()
                if more[0] == "error":
                    errors.append(f"[{more[1]} failed]:\n{more[2]}")
            _kill(procs)
            raise RuntimeError("\n".join(errors))


def _kill(procs: dict) -> None:
    for p in procs.values():
        if p.is_alive():
            p.kill()


def _result(run_dir: str, reports: list):
    import pandas as pd
    from ray.train import Checkpoint, Result

    saved = [
        (Checkpoint.from_directory(os.path.join(run_dir, name)), metrics)
        for metrics, name in reports
        if name is not None
    ]
    return Result(  # as Ray Train's: the latest checkpoint and its metrics
        metrics=saved[-1][1] if saved else (reports[-1][0] if reports else {}),
        checkpoint=saved[-1][0] if saved else None,
        error=None,
        path=run_dir,
        metrics_dataframe=pd.DataFrame([m for _, m in saved]) if saved else None,
        best_checkpoints=saved,
    )
