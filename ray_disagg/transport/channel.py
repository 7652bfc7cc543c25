"""The channel between the groups: the *links* between groups that talk across (a gloo
group each, and the NCCL communicators of their GPU pairs; :mod:`ray_disagg.transport.
links`), and the per-step statistics summed over every worker.

Each group has its own default ``torch.distributed`` group (set up by its Ray Train
backend). Control messages cross between groups over the links, built from a
``TCPStore`` that the coordinator asks the first group's rank 0 to host. Side ranks are
the groups' ranks in group order (e.g. ``[text 0..Nt-1, vision 0..Nv-1]``; the first
group, the LLM's, is the hub of the statistics). Tensors (activations, gradients) go over
the tier chosen for each pair of workers (``ray_disagg.transport``): the header over the
link's gloo group, the data over the tier. A worker that exchanges with no other group
(e.g. a model-parallel rank that is not its replica's leader) holds no link.

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
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ray_disagg.transport.base import ChannelSpec, TransferError, describe
from ray_disagg.transport.gloo import GlooTier
from ray_disagg.transport.links import LinkGroups, connect, plan_links
from ray_disagg.transport.shm import ShmTier, ShmUnavailable

__all__ = ["ChannelSpec", "Channel", "TransferError", "host_store", "join"]

logger = logging.getLogger(__name__)

_FIRST = 4096  # bytes of the first message of an object (its length + the start)
HUB_SHARE = 0.8
"""The hub's rank 0 waits for the other groups' sums at most this share of the timeout in
all, so its group (waiting in the broadcast under the same timeout) hears a failure
through the flag rather than timing out first."""


class Channel:
    """Point-to-point transfers with the workers of other groups this worker exchanges
    with, and the step's statistics summed over every worker (:meth:`all_reduce_sum`).

    All ranks are side ranks; ``rank_of(module, group_rank)`` converts. ``local``: this
    worker's own group's gloo group (``None``: a group of one worker)."""

    def __init__(self, spec: ChannelSpec, rank: int, store, links=(), local=None, device=None):
        self.spec, self.rank, self.local = spec, rank, local
        self.group = spec.group(rank)
        self._store = store  # keeps the TCP connection (and, on the host, the server) alive
        self.links: list[LinkGroups] = list(links)
        self._routes = {  # only the planned peers: no connection outside the handshake
            m: (lg.gloo, lg.link.rank(m)) for lg in self.links for m in lg.link.peers(rank)
        }
        nccl = {p: r for lg in self.links for p, r in lg.nccl.items()}
        self._tiers = {"gloo": GlooTier(self._route)}
        if nccl:
            from ray_disagg.transport.nccl import NcclTier

            self._tiers["nccl"] = NcclTier(rank, nccl, device)
        self._warned: set[str] = set()
        self.fallbacks = 0  # tensor messages sent over gloo instead of the planned tier
        self.closed = False

    @property
    def made(self) -> dict[str, int]:
        """Cross-group process groups this worker holds: ``{"gloo": n, "nccl": m}``."""
        nccl = {id(pg) for lg in self.links for pg, _ in (lg.nccl or {}).values()}
        return {"gloo": len(self.links), "nccl": len(nccl)}  # a gloo group per link

    @property
    def peers(self) -> list[int]:
        """Side ranks of the other groups this worker exchanges with (its connections)."""
        return sorted(self._routes)

    def _route(self, peer: int):
        """``(gloo group, the peer's rank in it)``: the link with ``peer``'s group."""
        route = self._routes.get(peer)
        if route is None:
            raise TransferError(
                f"{self.spec.label(peer)} is not a peer of {self.spec.label(self.rank)}: "
                "the transfer plan gives them no exchange (a worker talks only to its "
                "neighbours in the other groups; see ChannelSpec.tiers)"
            )
        return route

    def take_fallbacks(self) -> int:
        """Tensor messages sent over gloo, not their planned tier, since the last call."""
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
            pg, r = self._route(dst)
            pg.send([tensor.detach().contiguous().cpu()], r, 0).wait()

    def recv(self, shape, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        with self._guard("receiving a tensor from", src):
            pg, r = self._route(src)
            pg.recv([out], r, 0).wait()
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
        pg, r = self._route(dst)
        return [_Posted(pg.send([b], r, 0), b) for b in bufs]

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
        """``tensor`` summed over every worker of every group without a collective over
        them all: summed within the group (``local``), then each group's rank 0 sends its
        sum to the hub's (the first group's rank 0), which adds them in group order and
        sends the total back, and each rank 0 broadcasts it in its group with a flag. Call
        on every rank of every group; only rank 0 touches the links, and a failure there
        raises :class:`TransferError` on every rank of its group (a group that survives
        another's failure leaves the step together)."""
        buf = tensor.detach().cpu().clone()
        if self.local is not None:
            dist.all_reduce(buf, group=self.local)
        ok, error = True, None
        if self.rank == self.spec.offsets[self.group]:
            try:
                buf = self._sum_at_hub(buf)
            except Exception as e:  # noqa: BLE001 - every rank of the group must hear of it
                ok, error = False, e
        if self.local is not None:
            packed = torch.cat([buf.flatten(), torch.tensor([float(ok)], dtype=buf.dtype)])
            dist.broadcast(packed, group=self.local, group_src=0)
            buf, ok = packed[:-1].view_as(buf), bool(packed[-1])
        if error is not None and not isinstance(error, TransferError):
            raise TransferError(f"summing the statistics across groups: {error}") from error
        if not ok:
            raise error or TransferError(
                f"{self.spec.label(self.rank)}: its group's rank 0 could not sum the "
                "statistics with the other groups (another group failed)"
            )
        return buf

    def _sum_at_hub(self, buf: torch.Tensor) -> torch.Tensor:
        """Rank 0's part: send to the hub and receive the total, or (the hub) receive every
        group's sum at once, add them in group order and send the total back, waiting at
        most :data:`HUB_SHARE` of the timeout (its group hears of a failure in time)."""
        names = list(self.spec.offsets)
        hub, others = self.spec.offsets[names[0]], [self.spec.offsets[g] for g in names[1:]]
        if self.rank != hub:
            self.send(buf, hub)
            return self.recv(buf.shape, buf.dtype, hub)
        deadline, posted = time.monotonic() + HUB_SHARE * self.spec.timeout_s, []
        for r in others:  # every receive posted first: the waits overlap
            with self._guard("receiving the statistics from", r):
                pg, rank = self._route(r)
                posted.append((r, out := torch.empty_like(buf), pg.recv([out], rank, 0)))
        total = buf
        for r, out, work in posted:  # in group order: the same sum on every run
            with self._guard("receiving the statistics from", r):
                left = max(deadline - time.monotonic(), 0.001)
                if work.wait(timedelta(seconds=left)) is False:
                    raise TimeoutError(f"no statistics within {left:.0f}s")
            total = total + out
        for r in others:
            self.send(total, r)
        return total

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

                self._tiers[name] = CudaIpcTier(self._route)
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
        NCCL communicators and the links' gloo groups. Idempotent; best effort (a failing
        part is logged and the others are still released). ``abort=True`` (after a
        failure) aborts NCCL communicators instead of waiting for their queued work.

        A gloo group's connections close when its last reference goes (gloo's
        ``shutdown``/``abort`` leave them open), so this drops every reference it holds: a
        peer blocked in a receive from this rank is released at once, not after
        ``timeout_s`` (a failed group's survivors rely on it)."""
        if self.closed:
            return
        self.closed = True
        for name, tier in list(self._tiers.items()):
            if name != "gloo" and hasattr(tier, "close"):
                _best_effort(f"closing the {name} tier", tier.close, abort)
        for lg in self.links:
            _best_effort(f"shutting down the {lg.link.name} link", _shutdown, lg.gloo, abort)
            lg.gloo = lg.nccl = None
        self._tiers.clear()
        self._routes.clear()
        self._store = self.local = None


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


def join(
    spec: ChannelSpec, rank: int, node_ip: str, store=None, device=None, local=None
) -> Channel:
    """Connect this worker's links (call on every rank at once; a worker in no link
    returns at once): each link's lazy gloo group, one round of connections to this
    worker's peers in it, then its NCCL communicator, links in one global order
    (:func:`~ray_disagg.transport.links.plan_links`), so no two workers wait for each
    other. ``local``: this worker's group's gloo group (the statistics are summed in it)."""
    if store is None:
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(spec.master_addr, spec.master_port, None, False, timeout)
    links = [
        connect(link, spec, store, rank, node_ip, device)
        for link in plan_links(spec)
        if rank in link.members
    ]
    return Channel(spec, rank, store, links, local, device)
