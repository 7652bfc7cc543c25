"""Cross-device GPU tier: a two-rank NCCL group per pair of workers on different GPUs
(NCCL refuses two ranks of one communicator on the same GPU, so colocated pairs use
``cuda_ipc``). Built from the side group's store; the communicator itself is created by
NCCL on the pair's first transfer."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ray_disagg.transport.base import TensorSpec

__all__ = ["NcclTier", "pair_group"]


def pair_group(store, prefix: str, me: int, peer: int, device, timeout_s: float):
    """The NCCL group of side ranks ``me`` and ``peer`` (call on both, same arguments)."""
    lo, hi = sorted((me, peer))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    pg = dist.ProcessGroupNCCL(
        dist.PrefixStore(f"{prefix}/nccl/{lo}-{hi}", store), int(me == hi), 2, opts
    )
    return pg


class NcclTier:
    """Sends tensors straight from device memory over the pair's NCCL group."""

    name = "nccl"

    def __init__(self, me: int, groups: dict, device):
        self.me, self.groups, self.device = me, groups, device  # groups: peer -> pair group

    def _peer(self, other: int) -> int:
        return int(other > self.me)  # the other's rank inside the two-rank group

    def pack(self, tensors: list[torch.Tensor], dst: int):
        return None

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        """Posts the sends; returns ``(work, buffer)`` pairs to wait on."""
        pg, out = self.groups[dst], []
        for t in tensors:
            if t.numel():
                buf = t.detach().to(self.device).contiguous()
                out.append((pg.send([buf], self._peer(dst), 0), buf))
        return out

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        pg, out = self.groups[src], []
        for spec in specs:
            t = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
            if t.numel():
                pg.recv([t], self._peer(src), 0).wait()
            out.append(t.to(device))
        return out
