"""The channel between the groups: one gloo process group spanning every worker of every
group (its "side ranks"), plus the transfer tier of each pair of workers.

Each group has its own default ``torch.distributed`` group (set up by its Ray Train
backend). Control messages and the per-step statistics cross between groups over this
second, separate gloo group built from a ``TCPStore`` that the coordinator asks the first
group's rank 0 to host. Side ranks are the groups' ranks in group order (e.g. ``[vision
0..Nv-1, text 0..Nt-1]``). Tensors (activations, gradients) go over the tier chosen for
each pair of workers (``ray_disagg.transport``): the header over gloo, the data over the
tier.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ray_disagg.transport.base import describe
from ray_disagg.transport.gloo import GlooTier
from ray_disagg.transport.select import Location
from ray_disagg.transport.shm import ShmTier, ShmUnavailable

__all__ = ["ChannelSpec", "Channel", "host_store", "join"]

logger = logging.getLogger(__name__)

_FIRST = 4096  # bytes of the first message of an object (its length + the start)


@dataclass(frozen=True)
class ChannelSpec:
    """Where and how to rendezvous (sent by the coordinator to every worker)."""

    master_addr: str
    master_port: int
    offsets: dict[str, int]
    sizes: dict[str, int]
    timeout_s: float
    prefix: str
    locations: list[Location] = field(default_factory=list)
    """Where each side rank runs (reported by the workers)."""
    tiers: dict[tuple[int, int], str] = field(default_factory=dict)
    """Transfer tier of each pair of side ranks ``(low, high)`` in different groups."""

    @property
    def world_size(self) -> int:
        return sum(self.sizes.values())

    def tier(self, a: int, b: int) -> str:
        return self.tiers.get((min(a, b), max(a, b)), "gloo")

    def label(self, rank: int) -> str:
        for name, off in self.offsets.items():
            if off <= rank < off + self.sizes[name]:
                return f"{name} rank {rank - off}"
        return f"side rank {rank}"


class Channel:
    """Point-to-point transfers and small all-reduces between the module groups.

    All ranks are side ranks; ``rank_of(module, group_rank)`` converts.
    """

    def __init__(self, pg: dist.ProcessGroup, spec: ChannelSpec, rank: int, store, tiers=None):
        self.pg = pg
        self.spec = spec
        self.rank = rank
        self._store = store  # keeps the TCP connection (and, on the host, the server) alive
        self._tiers = {"gloo": GlooTier(pg), **(tiers or {})}
        self._warned: set[str] = set()
        self.fallbacks = 0  # tensor messages sent over gloo instead of the planned tier

    def rank_of(self, module: str, group_rank: int) -> int:
        return self.spec.offsets[module] + group_rank

    # ---- raw gloo (control) ---------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.pg.send([tensor.detach().contiguous().cpu()], dst, 0).wait()

    def recv(self, shape, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.pg.recv([out], src, 0).wait()
        return out

    def send_object(self, obj, dst: int) -> None:
        """Pickled ``obj`` in one gloo message when it fits in ``_FIRST`` bytes (each gloo
        message waits for the receiver: one, not two, for small headers)."""
        for work in self._post_object(obj, dst):
            work.wait()

    def _post_object(self, obj, dst: int) -> list:
        data = pickle.dumps(obj)
        first = np.zeros(_FIRST, dtype=np.uint8)
        first[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
        head = data[: _FIRST - 8]
        first[8 : 8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        bufs = [torch.from_numpy(first)]
        if len(data) > len(head):
            bufs.append(torch.from_numpy(np.frombuffer(data, dtype=np.uint8)[len(head) :].copy()))
        return [_Posted(self.pg.send([b], dst, 0), b) for b in bufs]

    def recv_object(self, src: int):
        first = self.recv((_FIRST,), torch.uint8, src).numpy()
        n = int(first[:8].view(np.int64)[0])
        data = first[8 : 8 + min(n, _FIRST - 8)].tobytes()
        if n > _FIRST - 8:
            data += self.recv((n - (_FIRST - 8),), torch.uint8, src).numpy().tobytes()
        return pickle.loads(data)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = tensor.detach().cpu().clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.pg.allreduce([buf], opts).wait()
        return buf

    # ---- named tensors over the pair's tier -----------------------------------------

    def tier_name(self, peer: int) -> str:
        return self.spec.tier(self.rank, peer)

    def _tier(self, name: str):
        if name not in self._tiers:
            if name == "shm":
                self._tiers[name] = ShmTier(self.spec.timeout_s)
            elif name == "cuda_ipc":
                from ray_disagg.transport.cuda_ipc import CudaIpcTier

                self._tiers[name] = CudaIpcTier()
            else:
                raise RuntimeError(f"transfer tier {name!r} is not set up on this worker")
        return self._tiers[name]

    def send_tensors(
        self, dst: int, tensors: dict[str, torch.Tensor], meta=None, wait: bool = True
    ):
        """Send named tensors (any dtype and device) and a picklable ``meta`` to ``dst``.
        With ``wait=False`` the sends are only posted: returns a handle whose ``wait()``
        must be called before the tensors are modified (messages to one peer arrive in
        order either way)."""
        name = self.tier_name(dst)
        items = list(tensors.values())
        tier = self._tier(name)
        try:
            payload = tier.pack(items, dst)
        except ShmUnavailable as e:  # e.g. a small /dev/shm: this message goes over gloo
            if "shm" not in self._warned:
                self._warned.add("shm")
                logger.warning("shared-memory transfer unavailable, using gloo: %s", e)
            name, tier, payload = "gloo", self._tiers["gloo"], None
            self.fallbacks += 1
        header = {"meta": meta, "specs": describe(tensors), "tier": name, "payload": payload}
        posted = self._post_object(header, dst)  # the receiver wakes up while data is written
        posted += [_Posted(w, b) for w, b in tier.after_header(items, dst)]
        handle = _Pending(posted)
        if wait:
            handle.wait()
        return handle

    def recv_tensors(self, src: int, device=None) -> tuple[object, dict[str, torch.Tensor]]:
        """``(meta, {name: tensor})`` sent by ``src``'s :meth:`send_tensors`; tensors land on
        ``device`` (default CPU)."""
        header = self.recv_object(src)
        device = torch.device("cpu") if device is None else device
        tier = self._tier(header["tier"])
        out = tier.unpack(header["specs"], header["payload"], src, device)
        return header["meta"], {s.name: t for s, t in zip(header["specs"], out)}

    def close(self) -> None:
        shm = self._tiers.get("shm")
        if shm is not None:
            shm.close()


class _Posted:
    """A posted gloo send and the buffer it reads (kept alive until it completes)."""

    def __init__(self, work, buf):
        self.work, self.buf = work, buf

    def wait(self) -> None:
        self.work.wait()
        self.buf = None


class _Pending:
    """Posted sends of one message."""

    def __init__(self, posted: list[_Posted]):
        self.posted = posted

    def wait(self) -> None:
        for p in self.posted:
            p.wait()
        self.posted = []


def host_store(addr: str, timeout_s: float):
    """Start the TCPStore server in this process; returns ``(store, port)``."""
    store = dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port


def join(spec: ChannelSpec, rank: int, node_ip: str, store=None, device=None) -> Channel:
    """Blocking rendezvous of all ``spec.world_size`` ranks (call on every rank at once);
    also connects the NCCL communicator of each of this rank's ``nccl`` pairs, in the
    global order of pairs (every rank connects its pairs in that order, so no two wait
    for each other)."""
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.master_addr, spec.master_port, None, False, timeout)
    prefixed = dist.PrefixStore(spec.prefix, store)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip)]
    pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, opts)
    tiers = {}
    pairs = sorted(p for p, t in spec.tiers.items() if t == "nccl")  # one global order
    if any(rank in p for p in pairs):
        from ray_disagg.transport.nccl import NcclTier, pair_group

        mine = {
            (b if a == rank else a): pair_group(
                store, spec.prefix, a, b, rank, spec.timeout_s, device
            )
            for a, b in pairs
            if rank in (a, b)
        }
        tiers["nccl"] = NcclTier(rank, mine, device)
    return Channel(pg, spec, rank, store, tiers)
