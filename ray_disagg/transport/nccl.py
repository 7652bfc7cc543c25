"""Cross-device GPU tier: two-rank NCCL groups between workers on different GPUs (NCCL
refuses two ranks of one communicator on the same GPU, so colocated pairs use
``cuda_ipc``). Built from the side group's store; the communicators are created by NCCL on
the first transfer.

Each direction of a pair has its own group: NCCL runs a group's sends and receives in issue
order on one stream, so with several microbatches in flight (an encoder posting two sends
before it receives, the LLM receiving, sending, receiving) one shared group would wait in
a cycle.

Failures: each pair group has the channel's timeout (``spec.timeout_s``) as its NCCL
watchdog timeout. :func:`surface_errors` (called before the pair groups are made) sets
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` ("clean up only") unless the user set it: when an
operation of a pair times out, torch's watchdog aborts that communicator (the stuck kernel
exits) instead of tearing the whole process down (torch's default, 3, kills the worker with
a watchdog message that names no peer), and the next wait or operation on that group raises
a ``RuntimeError`` that the channel re-raises as ``TransferError`` naming the peer. Waits
stay stream-ordered (``work.wait()`` makes the current stream wait; the host does not
block), so the error surfaces at the next transfer with that peer rather than at the
stuck one; the data of the aborted transfer is not valid. ``close()`` ends the groups:
``shutdown()`` (``ncclCommDestroy`` after queued work) normally, ``abort()`` after a
failure (a destroy would wait for work that never completes)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ray_disagg.transport.base import TensorSpec

__all__ = ["NcclTier", "pair_group", "surface_errors"]

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def surface_errors() -> None:
    """Make a timed-out pair operation raise in this process instead of killing it (read
    by each ``ProcessGroupNCCL`` when it is made; a value the user set is kept)."""
    os.environ.setdefault(ERROR_HANDLING_ENV, "2")


def pair_group(store, prefix: str, src: int, dst: int, me: int, timeout_s: float):
    """The NCCL group that carries side rank ``src``'s tensors to ``dst`` (rank 0 is the
    sender); call on both with the same ``src, dst``."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{prefix}/nccl/{src}-to-{dst}", store)
    return dist.ProcessGroupNCCL(store, int(me == dst), 2, opts)


class NcclTier:
    """Sends tensors straight from device memory over the pair's NCCL group."""

    name = "nccl"

    def __init__(self, me: int, outgoing: dict, incoming: dict, device):
        # peer -> the group carrying my tensors to it / its tensors to me
        self.me, self.outgoing, self.incoming, self.device = me, outgoing, incoming, device

    def pack(self, tensors: list[torch.Tensor], dst: int):
        return None

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        """Posts the sends; returns ``(work, buffer)`` pairs to wait on."""
        pg, out = self.outgoing[dst], []
        for t in tensors:
            if t.numel():
                buf = t.detach().to(self.device).contiguous()
                out.append((pg.send([buf], 1, 0), buf))  # the receiver is rank 1
        return out

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        pg, out = self.incoming[src], []
        for spec in specs:
            t = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
            if t.numel():
                pg.recv([t], 0, 0).wait()  # the sender is rank 0
            out.append(t.to(device))
        return out

    def close(self, abort: bool = False) -> None:
        """End every pair group of this rank (see the module docstring)."""
        groups = [*self.outgoing.values(), *self.incoming.values()]
        self.outgoing, self.incoming = {}, {}
        for pg in groups:
            if abort:
                pg.abort()
            else:
                pg.shutdown()
