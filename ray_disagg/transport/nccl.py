"""Cross-device GPU tier: one two-rank NCCL communicator per pair of workers on different
GPUs (NCCL refuses two ranks of one communicator on the same GPU, so colocated pairs use
``cuda_ipc``).

Deadlock freedom by construction:

- one communicator per pair, created eagerly when the groups join (``ncclCommInitRank``
  is itself a rendezvous of the pair), every worker creating its communicators in one
  global order (pairs sorted by side rank), so no two workers wait for each other there;
- a message (all the tensors of one action for one peer) is one send and one receive: its
  tensors are packed into one buffer;
- both workers of a pair issue their messages in the same order, derived from the same
  schedule (``ray_disagg.pipeline.schedule``; checked with in-order streams by
  ``ray_disagg.pipeline.simulate``), so NCCL matches the i-th send with the i-th receive
  on the pair's one stream.

Failures: each pair group has the channel's timeout (``spec.timeout_s``) as its NCCL
watchdog timeout. Each pair group is made under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
("clean up only"; Ray Train's backend sets 1 for the process, read at construction): when an
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

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ray_disagg.transport.base import TensorSpec, as_bytes, describe, from_bytes

__all__ = ["NcclTier", "pair_group", "pack", "unpack_views"]

_ALIGN = 16  # bytes: every tensor of a packed message starts at a multiple (any dtype)
ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@contextlib.contextmanager
def _clean_up_only():
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` while a pair group is made (its constructor
    reads it): a failed or timed-out pair operation, or a dead peer, aborts that
    communicator only; the watchdog never tears this survivor down. Ray Train's backend
    sets ``1`` (tear down) for the group's own process groups, which stay as they are."""
    old = os.environ.get(ERROR_HANDLING_ENV)
    os.environ[ERROR_HANDLING_ENV] = "2"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ERROR_HANDLING_ENV, None)
        else:
            os.environ[ERROR_HANDLING_ENV] = old


def pair_group(store, prefix: str, a: int, b: int, me: int, timeout_s: float, device):
    """The NCCL communicator of side ranks ``a < b`` (rank 0 is ``a``), connected now; call
    on both, in the same global order of pairs on every worker."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{prefix}/nccl/{a}-{b}", store)
    with _clean_up_only():
        pg = dist.ProcessGroupNCCL(store, int(me == b), 2, opts)
    pg.eager_connect_single_device(torch.device(device))
    return pg


def _offsets(specs: list[TensorSpec]) -> tuple[list[int], int]:
    offsets, n = [], 0
    for s in specs:
        offsets.append(n)
        n += (s.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, n


def pack(tensors: list[torch.Tensor], specs: list[TensorSpec], device) -> torch.Tensor:
    """The message's tensors in one ``uint8`` buffer on ``device``."""
    offsets, n = _offsets(specs)
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    for t, s, o in zip(tensors, specs, offsets):
        if s.nbytes:
            buf[o : o + s.nbytes].copy_(as_bytes(t.to(device)))
    return buf


def unpack_views(buf: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """The tensors ``specs`` describe, viewing the packed buffer (no copy)."""
    offsets, _ = _offsets(specs)
    return [from_bytes(buf[o : o + s.nbytes], s) for s, o in zip(specs, offsets)]


class NcclTier:
    """Sends a message's tensors straight from device memory over the pair's communicator."""

    name = "nccl"

    def __init__(self, me: int, pairs: dict, device):
        # peer side rank -> the pair's communicator (rank 0: the lower side rank)
        self.me, self.pairs, self.device = me, pairs, device

    def _peer_rank(self, peer: int) -> int:
        return int(peer > self.me)

    def _pair(self, peer: int):
        pg = self.pairs.get(peer)
        if pg is None:  # interrupted: the peer's group failed
            raise RuntimeError(f"the NCCL pair with side rank {peer} was aborted")
        return pg

    def pack(self, tensors: list[torch.Tensor], dst: int):
        return None

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        """Posts the one send of the message; returns ``(work, buffer)`` to wait on."""
        specs = describe({str(i): t for i, t in enumerate(tensors)})
        if not any(s.nbytes for s in specs):
            return []
        buf = pack(tensors, specs, self.device)
        return [(self._pair(dst).send([buf], self._peer_rank(dst), 0), buf)]

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        _, n = _offsets(specs)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._pair(src).recv([buf], self._peer_rank(src), 0).wait()
        return [t.to(device) for t in unpack_views(buf, specs)]

    def interrupt(self, peers) -> None:
        """Abort the communicators with ``peers`` (a failed group's ranks) now, from any
        thread: ``ncclCommAbort`` ends their queued or stuck kernels, so no operation of
        this rank waits on a dead peer (the watchdog cleans up only, see the module
        docstring). The pairs are gone; :meth:`close` ends the rest."""
        for peer in peers:
            pg = self.pairs.pop(peer, None)
            if pg is not None:
                pg.abort()

    def close(self, abort: bool = False) -> None:
        """End every pair communicator of this rank (see the module docstring)."""
        groups, self.pairs = list(self.pairs.values()), {}
        for pg in groups:
            if abort:
                pg.abort()
            else:
                pg.shutdown()
