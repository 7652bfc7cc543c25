"""The side process group that spans all module groups.

Each module group has its own default ``torch.distributed`` group (set up by its Ray Train
backend). Activations and gradients cross between groups over a second, separate gloo
group built from a ``TCPStore`` that the coordinator asks the first group's rank 0 to
host. Side ranks are the groups' ranks in group order (e.g. ``[vision 0..Nv-1, text
0..Nt-1]``).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["SideGroupSpec", "SideGroup", "host_store", "join"]


@dataclass(frozen=True)
class SideGroupSpec:
    """Where and how to rendezvous (sent by the coordinator to every worker)."""

    master_addr: str
    master_port: int
    offsets: dict[str, int]
    sizes: dict[str, int]
    timeout_s: float
    prefix: str

    @property
    def world_size(self) -> int:
        return sum(self.sizes.values())


class SideGroup:
    """Point-to-point transfers and small all-reduces between the module groups.

    All ranks are side ranks; ``rank_of(module, group_rank)`` converts.
    """

    def __init__(self, pg: dist.ProcessGroup, spec: SideGroupSpec, rank: int, store):
        self.pg = pg
        self.spec = spec
        self.rank = rank
        self._store = store  # keeps the TCP connection (and, on the host, the server) alive
        self._tag = 0

    def rank_of(self, module: str, group_rank: int) -> int:
        return self.spec.offsets[module] + group_rank

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.pg.send([tensor.detach().contiguous().cpu()], dst, 0).wait()

    def recv(self, shape, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.pg.recv([out], src, 0).wait()
        return out

    def send_object(self, obj, dst: int) -> None:
        payload = torch.from_numpy(np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy())
        self.send(torch.tensor([payload.numel()], dtype=torch.int64), dst)
        self.send(payload, dst)

    def recv_object(self, src: int):
        (n,) = self.recv((1,), torch.int64, src).tolist()
        return pickle.loads(self.recv((n,), torch.uint8, src).numpy().tobytes())

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = tensor.detach().cpu().clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.pg.allreduce([buf], opts).wait()
        return buf


def host_store(addr: str, timeout_s: float):
    """Start the TCPStore server in this process; returns ``(store, port)``."""
    store = dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port


def join(spec: SideGroupSpec, rank: int, node_ip: str, store=None) -> SideGroup:
    """Blocking rendezvous of all ``spec.world_size`` ranks (call on every rank at once)."""
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.master_addr, spec.master_port, None, False, timeout)
    prefixed = dist.PrefixStore(spec.prefix, store)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip)]
    pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, opts)
    return SideGroup(pg, spec, rank, store)
