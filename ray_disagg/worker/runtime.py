"""Per-worker-process state: the group's device mesh and the channel to the other groups.

The module's Ray Train backend fills it in when the group starts (like Ray Train's own
train context); the coordinator adds the channel once every group is up. The training
loop reads it once and passes meshes and groups explicitly from there on.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ray_disagg.transport import channel as sg
from ray_disagg.transport.select import Location
from ray_disagg.worker.session import get_session

logger = logging.getLogger(__name__)

__all__ = [
    "WorkerRuntime",
    "get_runtime",
    "init_runtime",
    "locate",
    "host_channel_store",
    "join_channel",
    "wait_parked",
    "interrupt_transfers",
    "close_channel",
]


@dataclass
class WorkerRuntime:
    module: str
    mesh: DeviceMesh
    device: torch.device
    object_group: object = None
    """A gloo group over the whole group: objects (pickled) never go through NCCL."""
    mp_object_group: object = None
    """A gloo group over this worker's model-parallel peers, for objects."""
    checkpoint_group: object = None
    """A gloo group over the whole group for asynchronous checkpoint writes (their
    background collectives never interleave with the training thread's)."""
    channel: sg.Channel | None = None
    _channel_ready: threading.Event = field(default_factory=threading.Event)
    _channel_error: BaseException | None = None
    _store: object = None
    _rejoined: threading.Condition = field(default_factory=threading.Condition)
    _resume: tuple | None = None  # (generation, checkpoint) a survivor continues from
    parked: threading.Event = field(default_factory=threading.Event)
    """Set while the training thread waits for a rebuilt channel (a group restarts)."""
    reloaded: threading.Event = field(default_factory=threading.Event)
    """Set once a survivor reloaded the checkpoint (its channel is then rebuilt)."""

    def wait_channel(self, timeout_s: float) -> sg.Channel:
        if not self._channel_ready.wait(timeout_s):
            raise TimeoutError(
                f"[{self.module}] the channel to the other groups was not ready after "
                f"{timeout_s:.0f}s; another module group probably failed to start."
            )
        if self._channel_error is not None:
            raise RuntimeError(f"[{self.module}] channel setup failed") from self._channel_error
        return self.channel

    def wait_resume(self, generation: int, timeout_s: float):
        """Park until the coordinator names the checkpoint to continue from after the
        channel of ``generation`` failed (another group restarts); returns it."""
        self.parked.set()
        ok = self._wait(
            lambda: self._resume is not None and self._resume[0] > generation, timeout_s
        )
        if not ok:
            raise TimeoutError(
                f"[{self.module}] another group failed and was not restarted within "
                f"{timeout_s:.0f}s; the run restarts every group."
            )
        return self._resume[1]

    def wait_rejoin(self, generation: int, timeout_s: float) -> sg.Channel:
        """The channel rebuilt past ``generation`` (once the restarted group is up)."""
        try:
            ok = self._wait(
                lambda: self.channel is not None and self.channel.spec.generation > generation,
                timeout_s,
            )
        finally:
            self.parked.clear()
            self.reloaded.clear()
        if not ok:
            raise TimeoutError(f"[{self.module}] the restarted group did not join in time")
        return self.channel

    def _wait(self, predicate, timeout_s: float) -> bool:
        with self._rejoined:
            return self._rejoined.wait_for(predicate, timeout_s)


_runtime: WorkerRuntime | None = None


def get_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError(
            "ray_disagg worker runtime is not initialised: this code must run inside a "
            "DisaggregatedTrainer worker."
        )
    return _runtime


def init_runtime(
    module: str,
    mesh_shape: tuple[int, ...],
    mesh_axes: tuple[str, ...],
    timeout_s: float | None = None,
) -> None:
    """Build the group's named device mesh over its default process group (and the gloo
    groups: ``timeout_s`` is the checkpoint group's)."""
    global _runtime
    from ray_disagg.worker.memory import limit_heap_fragmentation

    device = get_session().device()
    if device.type == "cpu":  # tensors live in host memory: keep it from fragmenting
        limit_heap_fragmentation()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # fp32 means fp32 (layouts must equal the single-process model); bf16=True is the
        # fast path. cuDNN convolutions (the patch embedding) default to TF32 otherwise.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=mesh_axes)
    _runtime = WorkerRuntime(module=module, mesh=mesh, device=device)
    _runtime.object_group, _runtime.mp_object_group = _object_groups(mesh, device)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    _runtime.checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)


def _object_groups(mesh: DeviceMesh, device: torch.device):
    """Gloo groups for pickled objects: the whole group and each replica's model-parallel
    group, every axis after the first (on CPU a 2-D mesh's own groups are gloo already).
    Every rank creates every group, in mesh order, as ``new_group`` requires."""
    if device.type == "cpu" and mesh.ndim == 2:
        return dist.group.WORLD, mesh[mesh.mesh_dim_names[1]].get_group()
    whole = dist.group.WORLD if device.type == "cpu" else dist.new_group(backend="gloo")
    rows = mesh.mesh.reshape(mesh.mesh.shape[0], -1).tolist()  # the ranks of each replica
    mine, _ = dist.new_subgroups_by_enumeration(rows, backend="gloo")
    return whole, mine


def locate() -> Location:
    """Where this worker runs: node, process, device (GPU UUID), placement bundle."""
    import os

    rt, session = get_runtime(), get_session()
    gpu = None
    if rt.device.type == "cuda":
        gpu = str(torch.cuda.get_device_properties(rt.device).uuid)
    pg, bundle = session.placement()
    return Location(
        node=session.node_id(),
        pid=os.getpid(),
        device=rt.device.type,
        gpu=gpu,
        placement_group=pg,
        bundle=bundle,
    )


def host_channel_store(timeout_s: float) -> tuple[str, int]:
    addr = get_session().node_ip()
    store, port = sg.host_store(addr, timeout_s)
    get_runtime()._store = store
    return addr, port


def join_channel(spec: sg.ChannelSpec, module: str, group_rank: int) -> None:
    """Join the side channel (every worker at once; ``spec.generation > 0``: rebuilt after
    a group restarted)."""
    rt = get_runtime()
    if rt._resume is not None and rt._resume[0] == spec.generation:  # a survivor: its
        rt.reloaded.wait(spec.timeout_s)  # NCCL pairs are made after its reload's collectives
    try:
        rank = spec.offsets[module] + group_rank
        ip, local = get_session().node_ip(), rt.object_group
        channel = sg.join(spec, rank, ip, store=rt._store, device=rt.device, local=local)
        if spec.generation == 0:
            atexit.register(close_channel)  # a worker that exits without the driver's call
        with rt._rejoined:
            rt.channel = channel
            rt._rejoined.notify_all()
    except BaseException as e:
        rt._channel_error = e
        raise
    finally:
        rt._channel_ready.set()


def interrupt_transfers(group: str, generation: int, resume) -> None:
    """``group`` failed (any thread): this worker's transfers with it give up now, and
    once its training thread parks it continues from checkpoint ``resume`` on the
    channel of ``generation``."""
    rt = get_runtime()
    if rt.channel is not None and not rt.channel.closed:
        rt.channel.interrupt(group)  # first: the training thread then reloads alone
    with rt._rejoined:
        rt._resume = (generation, resume)
        rt._rejoined.notify_all()


def wait_parked(timeout_s: float) -> bool:
    """Whether this worker's training thread is parked (waiting for a rebuilt channel)
    within ``timeout_s``."""
    return get_runtime().parked.wait(timeout_s)


def close_channel(abort: bool = False) -> bool:
    """Release this worker's channel (shared-memory segments, CUDA IPC mappings, NCCL
    communicators, the links' gloo groups); the driver runs it on every worker before the groups
    shut down, and at exit. Best effort: never raises; ``True`` when a channel was closed."""
    rt = _runtime
    if rt is None or rt.channel is None:
        return False
    channel, rt.channel = rt.channel, None
    try:
        channel.close(abort=abort)
    except Exception:
        logger.warning("[%s] closing the channel failed", rt.module, exc_info=True)
    rt._store = None
    return True
