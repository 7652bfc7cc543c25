"""The channel between the groups: one gloo process group spanning every worker of every
group (its "side ranks"), plus the transfer tier of each pair of workers.

Each group has its own default ``torch.distributed`` group (set up by its Ray Train
backend). Control messages and the per-step statistics cross between groups over this
second, separate gloo group built from a ``TCPStore`` that the coordinator asks the first
group's rank 0 to host. Side ranks are the groups' ranks in group order (e.g. ``[vision
0..Nv-1, text 0..Nt-1]``). Tensors (activations, gradients) go over the tier chosen for
each pair of workers (``ray_disagg.transport``): the header over gloo, the data over the
tier.

One meaning of ``wait()`` on every tier: once the handle of ``send_tensors(...,
wait=False)`` has been waited on, the send buffers may be reused (written or freed) by work
the sender issues afterwards (on its current CUDA stream for device tensors). gloo and shm
complete when the data has left the buffers; nccl orders the current stream after the
send; cuda_ipc after the receiver's copy out of the sender's memory (see
:mod:`ray_disagg.transport.cuda_ipc`). Every wait is bounded by ``spec.timeout_s``: a
timeout or a failed transfer raises :class:`TransferError` (a ``TimeoutError``, and a
``RuntimeError`` for callers of older versions) naming the peer (``"text rank 0"``) and the
message, instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
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

__all__ = ["ChannelSpec", "Channel", "TransferError", "host_store", "join"]

logger = logging.getLogger(__name__)

_FIRST = 4096  # bytes of the first message of an object (its length + the start)


class TransferError(TimeoutError, RuntimeError):
    """A cross-group transfer timed out or failed; the message names the peer."""


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
    generation: int = 0
    """How many times the channel was rebuilt in this run attempt (a group restarted)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Group -> how many times it alone was restarted in this run attempt."""
    takeovers: dict[str, int] = field(default_factory=dict)
    """Group with a standby -> how many of those restarts its standby took."""

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
        self.closed = False

    def take_fallbacks(self) -> int:
        """Tensor messages sent over gloo instead of their planned tier since the last
        call."""
        n, self.fallbacks = self.fallbacks, 0
        return n

    def rank_of(self, module: str, group_rank: int) -> int:
        return self.spec.offsets[module] + group_rank

    @contextlib.contextmanager
    def _guard(self, what: str, peer: int | None):
        """Re-raise a failed or timed-out wait as :class:`TransferError` naming the peer."""
        self._check_open(what, peer)
        try:
            yield
        except (TransferError, ShmUnavailable):  # the latter: the sender falls back to gloo
            raise
        except (RuntimeError, TimeoutError, OSError) as e:
            who = self._who(peer)
            raise TransferError(
                f"{what} {who} (side rank {self.rank} = {self.spec.label(self.rank)}) failed "
                f"or timed out (timeout_s={self.spec.timeout_s:g}): {e}"
            ) from e

    # ---- raw gloo (control) ---------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self._guard("sending a tensor to", dst):
            self.pg.send([tensor.detach().contiguous().cpu()], dst, 0).wait()

    def recv(self, shape, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        with self._guard("receiving a tensor from", src):
            self.pg.recv([out], src, 0).wait()
        return out

    def send_object(self, obj, dst: int) -> None:
        """Pickled ``obj`` in one gloo message when it fits in ``_FIRST`` bytes (each gloo
        message waits for the receiver: one, not two, for small headers)."""
        with self._guard(f"sending {_describe(obj)} to", dst):
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
        with self._guard("receiving a message from", src):
            return self._recv_object(src)

    def _recv_object(self, src: int):
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
        with self._guard("all-reducing with", None):
            self.pg.allreduce([buf], opts).wait()
        return buf

    # ---- named tensors over the pair's tier -----------------------------------------

    def tier_name(self, peer: int) -> str:
        return self.spec.tier(self.rank, peer)

    def _who(self, peer: int | None) -> str:
        return "the other groups" if peer is None else self.spec.label(peer)

    def _check_open(self, what: str | None = None, peer: int | None = None) -> None:
        if self.closed:
            prefix = "" if what is None else f"{what} {self._who(peer)}: "
            raise TransferError(
                f"{prefix}the channel of side rank {self.rank} ({self.spec.label(self.rank)}) "
                "is closed (the run ended or a group failed); no more transfers"
            )

    def _tier(self, name: str):
        self._check_open()
        if name not in self._tiers:
            if name == "shm":
                self._tiers[name] = ShmTier(self.spec.timeout_s)
            elif name == "cuda_ipc":
                from ray_disagg.transport.cuda_ipc import CudaIpcTier

                self._tiers[name] = CudaIpcTier(self.pg)
            else:
                raise RuntimeError(f"transfer tier {name!r} is not set up on this worker")
        return self._tiers[name]

    def send_tensors(
        self, dst: int, tensors: dict[str, torch.Tensor], meta=None, wait: bool = True
    ):
        """Send named tensors (any dtype and device) and a picklable ``meta`` to ``dst``.
        With ``wait=False`` the sends are only posted: returns a handle whose ``wait()``
        must be called before the tensors are modified or freed (messages to one peer
        arrive in order either way); see the module docstring for what ``wait()`` means."""
        what = f"sending {_describe(meta, tensors)} to"
        name = self.tier_name(dst)
        items = list(tensors.values())
        tier = self._tier(name)
        try:
            with self._guard(what, dst):
                payload = tier.pack(items, dst)
        except ShmUnavailable as e:  # e.g. a small /dev/shm: this message goes over gloo
            if "shm" not in self._warned:
                self._warned.add("shm")
                logger.warning("shared-memory transfer unavailable, using gloo: %s", e)
            name, tier, payload = "gloo", self._tiers["gloo"], None
            self.fallbacks += 1
        header = {"meta": meta, "specs": describe(tensors), "tier": name, "payload": payload}
        with self._guard(what, dst):
            posted = self._post_object(header, dst)  # the receiver wakes up while data moves
            posted += [_Posted(w, b) for w, b in tier.after_header(items, dst)]
        handle = _Pending(posted, functools.partial(self._guard, what, dst))
        if wait:
            handle.wait()
        return handle

    def recv_tensors(self, src: int, device=None) -> tuple[object, dict[str, torch.Tensor]]:
        """``(meta, {name: tensor})`` sent by ``src``'s :meth:`send_tensors`; tensors land on
        ``device`` (default CPU)."""
        with self._guard("receiving a message from", src):
            header = self._recv_object(src)
        device = torch.device("cpu") if device is None else device
        with self._guard(f"receiving {_describe(header['meta'], header['specs'])} from", src):
            tier = self._tier(header["tier"])
            out = tier.unpack(header["specs"], header["payload"], src, device)
        return header["meta"], {s.name: t for s, t in zip(header["specs"], out)}

    def interrupt(self, group: str) -> None:
        """From any thread, when ``group`` failed: transfers with its ranks that wait
        outside gloo (shared-memory flags, NCCL kernels) give up at once, as gloo's do when
        the dead peer's connections close. The training thread then closes the channel."""
        peers = range(self.spec.offsets[group], self.spec.offsets[group] + self.spec.sizes[group])
        for tier in list(self._tiers.values()):
            if hasattr(tier, "interrupt"):
                _best_effort("interrupting a tier", tier.interrupt, list(peers))

    def close(self, abort: bool = False) -> None:
        """Release what the channel holds: shared-memory segments, CUDA IPC mappings, the
        NCCL pair groups and the gloo group. Idempotent; best effort (a failing part is
        logged and the others are still released). ``abort=True`` (after a failure)
        aborts NCCL communicators instead of waiting for their queued work.

        The gloo group's connections close when its last reference goes (gloo's
        ``shutdown``/``abort`` leave them open), so this drops every reference it holds: a
        peer blocked in a receive from this rank is released at once, not after
        ``timeout_s`` (a failed group's survivors rely on it)."""
        if self.closed:
            return
        self.closed = True
        for name, tier in list(self._tiers.items()):
            if name != "gloo" and hasattr(tier, "close"):
                _best_effort(f"closing the {name} tier", tier.close, abort)
        _best_effort("shutting down the side gloo group", _shutdown, self.pg, abort)
        self._tiers.clear()
        self.pg = self._store = None


def _best_effort(what: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        logger.warning("channel close: %s failed", what, exc_info=True)


def _shutdown(pg, abort: bool) -> None:
    """End a process group created directly (not registered with ``torch.distributed``,
    so ``dist.destroy_process_group`` does not know it)."""
    if abort and hasattr(pg, "abort"):
        pg.abort()
    elif hasattr(pg, "shutdown"):
        pg.shutdown()


def _describe(meta, tensors=None) -> str:
    """A short name of a message for errors: its meta's type and its tensors' names."""
    kind = type(meta).__name__ if meta is not None else "a message"
    key = getattr(meta, "key", None)
    text = f"{kind} {key}" if key is not None else kind
    if tensors:
        names = [getattr(t, "name", t) for t in tensors]
        text += f" with tensors {names[:6]}" + (" ..." if len(names) > 6 else "")
    return text


class _Posted:
    """A posted send (or the tier's acknowledgement) and the buffer it reads (kept alive
    until it completes)."""

    def __init__(self, work, buf):
        self.work, self.buf = work, buf

    def wait(self) -> None:
        self.work.wait()
        self.buf = None


class _Pending:
    """Posted sends of one message; ``wait()`` errors name the peer."""

    def __init__(self, posted: list[_Posted], guard):
        self.posted, self._guard = posted, guard

    def wait(self) -> None:
        with self._guard():
            while self.posted:
                self.posted[0].wait()
                self.posted.pop(0)


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
