"""Cross-device GPU tier: NCCL point-to-point between workers on different GPUs (NCCL
refuses two ranks of one communicator on the same GPU, so colocated pairs use
``cuda_ipc``).

Communicators: one per connected part of a link's NCCL pairs
(:mod:`ray_disagg.transport.links`), so a worker holds one per other group it exchanges
with, whatever the number of replicas; a part with two members on one GPU keeps a
two-rank communicator per pair (:func:`pair_group`). A link communicator is connected
eagerly (:func:`link_group`), and torch then issues every send and receive on it on that
one communicator and its one stream (no lazily made two-rank communicators; the
unbatched operations are serialized, which is what the rules below need).

Deadlock freedom by construction:

- communicators are created when the groups join (``ncclCommInitRank`` is one rendezvous
  of the part), every worker taking its links in one global order, so no two workers
  wait for each other there;
- a message (all the tensors of one action for one peer) is one send and one receive: its
  tensors are packed into one buffer;
- both workers of a pair issue their messages in the same order, derived from the same
  schedule (``ray_disagg.pipeline.schedule``), and every worker's operations, whichever
  peer and communicator, are replayed on one in-order queue by
  ``ray_disagg.pipeline.simulate`` (stricter than one stream per communicator), so NCCL
  matches the i-th send with the i-th receive and no stream waits in a cycle.

Failures: each communicator has the channel's timeout (``spec.timeout_s``) as its NCCL
watchdog timeout. Each is made under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
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

__all__ = ["NcclTier", "link_group", "pair_group", "pack", "unpack_views"]

_ALIGN = 16  # bytes: every tensor of a packed message starts at a multiple (any dtype)
ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# the unbatched sends and receives on a link's communicator are serialized on purpose
SERIALIZATION_WARNING_ENV = "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"


@contextlib.contextmanager
def _clean_up_only():
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` while a pair group is made (its constructor
    reads it): a failed or timed-out pair operation, or a dead peer, aborts that
    communicator only; the watchdog never tears this survivor down. Ray Train's backend
    sets ``1`` (tear down) for the group's own process groups, which stay as they are."""
    settings = {ERROR_HANDLING_ENV: "2", SERIALIZATION_WARNING_ENV: "false"}
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _nccl_group(store, rank: int, size: int, timeout_s: float, device):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    with _clean_up_only():
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    pg.eager_connect_single_device(torch.device(device))
    return pg


def pair_group(store, prefix: str, a: int, b: int, me: int, timeout_s: float, device):
    """The NCCL communicator of side ranks ``a < b`` (rank 0 is ``a``), connected now; call
    on both, in the same global order on every worker."""
    store = dist.PrefixStore(f"{prefix}/nccl/{a}-{b}", store)
    return _nccl_group(store, int(me == b), 2, timeout_s, device)


def link_group(store, prefix: str, part: tuple[int, ...], me: int, timeout_s: float, device):
    """One NCCL communicator over the side ranks ``part`` (sorted; a member's rank is its
    index), connected now: its point-to-point operations then all use it (torch's eager
    initialization), never a lazily made two-rank communicator. Call on every member."""
    store = dist.PrefixStore(prefix, store)
    return _nccl_group(store, part.index(me), len(part), timeout_s, device)


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
    """Sends a message's tensors straight from device memory over the peer's
    communicator."""

    name = "nccl"

    def __init__(self, me: int, peers: dict, device):
        # peer side rank -> (communicator, the peer's rank in it)
        self.me, self.peers, self.device = me, peers, device

    def _route(self, peer: int):
        route = self.peers.get(peer)
        if route is None:  # interrupted: the peer's group failed
            raise RuntimeError(f"the NCCL communicator with side rank {peer} was aborted")
        return route

    def pack(self, tensors: list[torch.Tensor], dst: int):
        return None

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        """Posts the one send of the message; returns ``(work, buffer)`` to wait on."""
        specs = describe({str(i): t for i, t in enumerate(tensors)})
        if not any(s.nbytes for s in specs):
            return []
        buf = pack(tensors, specs, self.device)
        pg, rank = self._route(dst)
        return [(pg.send([buf], rank, 0), buf)]

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        _, n = _offsets(specs)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            pg, rank = self._route(src)
            pg.recv([buf], rank, 0).wait()
        return [t.to(device) for t in unpack_views(buf, specs)]

    def interrupt(self, peers) -> None:
        """Abort the communicators with ``peers`` (a failed group's ranks) now, from any
        thread: ``ncclCommAbort`` ends their queued or stuck kernels, so no operation of
        this rank waits on a dead peer (the watchdog cleans up only, see the module
        docstring). Every peer on an aborted communicator is gone (a link's peers are all
        of one other group); :meth:`close` ends the rest."""
        mine = self.peers  # one read: close() may swap it meanwhile
        doomed = {id(mine[p][0]): mine[p][0] for p in peers if p in mine}
        self.peers = {p: r for p, r in mine.items() if id(r[0]) not in doomed}
        for pg in doomed.values():
            pg.abort()

    def close(self, abort: bool = False) -> None:
        """End every communicator of this rank (see the module docstring)."""
        groups = {id(pg): pg for pg, _ in self.peers.values()}
        self.peers = {}
        for pg in groups.values():
            if abort:
                pg.abort()
            else:
                pg.shutdown()
