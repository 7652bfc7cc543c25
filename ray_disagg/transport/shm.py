"""Same-node CPU tier: the sender copies a message's tensors once into a shared-memory
buffer; the receiver maps that buffer and hands out tensors that view it (no socket copy,
no second copy).

Each sender keeps a small pool of segments per receiver. A segment starts with two words:
``busy``, set by the sender when it reserves the segment and cleared by the receiver when
the last tensor viewing the segment is freed (a finalizer on the storage's owner), and
``ready``, the sequence number of the message whose data is complete. The header (sent
over gloo) goes out before the copy, so the receiver wakes up while the sender copies; it
then waits for ``ready``. The sender reuses only
free segments, grows the pool up to ``max_segments`` and otherwise waits, up to its
timeout, for one to be freed: a receiver that died surfaces as a ``TimeoutError``.
Segments are unlinked by their sender on close, or by Python's resource tracker when the
sender dies.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import time
import weakref
from multiprocessing import shared_memory

import numpy as np
import torch

from ray_disagg.transport.base import TensorSpec, from_bytes

__all__ = ["ShmTier", "ShmUnavailable"]

logger = logging.getLogger(__name__)

_HEADER = 64  # bytes before the data: busy and ready (int64 each); cache-line aligned data
_ALIGN = 64
_BUSY, _READY = 0, 1
_FENCE = threading.Lock()  # acquire/release: a full memory barrier on every architecture


def _fence() -> None:
    with _FENCE:
        pass


class ShmUnavailable(OSError):
    """The shared-memory buffer could not be created (e.g. /dev/shm is full)."""


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Segment:
    def __init__(self, shm, owner: bool):
        self.shm, self.owner = shm, owner
        self.words = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
        self.capacity = shm.size - _HEADER

    @property
    def busy(self) -> bool:
        return bool(self.words[_BUSY])

    def close(self) -> None:
        self.words = None
        try:
            self.shm.close()
            if self.owner:
                self.shm.unlink()
        except (BufferError, FileNotFoundError):  # still viewed, or already unlinked
            pass


def _create(name: str, size: int) -> shared_memory.SharedMemory:
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    except OSError as e:
        raise ShmUnavailable(f"cannot create shared memory {name} of {size} bytes: {e}") from e
    try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
        os.posix_fallocate(shm._fd, 0, size)
    except OSError as e:
        shm.close()
        shm.unlink()
        raise ShmUnavailable(
            f"/dev/shm has no room for {size / 2**20:.1f} MiB ({e}); enlarge it "
            "(docker --shm-size) or set transfer='gloo'"
        ) from e
    return shm


class _Attached:
    """A receiver's mapping of a sender's segment (not registered with any resource
    tracker: the sender owns and unlinks it)."""

    def __init__(self, name: str):
        fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self.buf.release()  # BufferError while tensors still view it
        self._mmap.close()


class ShmTier:
    """Shared-memory transfers between processes of one node."""

    name = "shm"

    def __init__(
        self,
        timeout_s: float,
        max_segments: int = 8,
        min_bytes: int = 1 << 20,
        grace_s: float = 0.01,
    ):
        self.timeout_s, self.max_segments, self.min_bytes = timeout_s, max_segments, min_bytes
        self.grace_s = grace_s
        self._tag = f"rd{os.getpid()}_{secrets.token_hex(3)}"
        self._made = self._seq = 0
        self._pools: dict[int, list[_Segment]] = {}  # sender: per receiver
        self._pending: dict[int, tuple] = {}  # sender: reserved, not yet written
        self._attached: dict[str, _Segment] = {}  # receiver: by name

    # ---- sender ----------------------------------------------------------------------

    def _segment_for(self, nbytes: int, dst: int) -> _Segment:
        pool = self._pools.setdefault(dst, [])
        start = time.monotonic()
        while True:
            free = [s for s in pool if not s.busy]
            fit = [s for s in free if s.capacity >= nbytes]
            if fit:
                return min(fit, key=lambda s: s.capacity)
            # a buffer about to be freed beats a new one (whose pages fault on first use)
            held = any(s.capacity >= nbytes for s in pool)
            if held and time.monotonic() - start < self.grace_s:
                time.sleep(0.0001)
                continue
            if free or len(pool) < self.max_segments:
                if free:  # replace a free segment that is too small
                    pool.remove(free[0])
                    free[0].close()
                self._made += 1
                size = _HEADER + max(self.min_bytes, 1 << (nbytes - 1).bit_length())
                seg = _Segment(_create(f"{self._tag}_{self._made}", size), owner=True)
                pool.append(seg)
                return seg
            if time.monotonic() - start > self.timeout_s:
                raise TimeoutError(
                    f"shm transfer to side rank {dst}: all {len(pool)} buffers still held by "
                    f"the receiver after {self.timeout_s:.0f}s (did it die?)"
                )
            time.sleep(0.0005)

    def pack(self, tensors: list[torch.Tensor], dst: int):
        """Reserve a segment and lay the message out (the header goes out next)."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        if not sum(sizes):
            return None
        seg = self._segment_for(sum(sizes), dst)
        seg.words[_BUSY], seg.words[_READY] = 1, 0
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._seq += 1
        self._pending[dst] = (seg, offsets, self._seq)
        return {"segment": seg.shm.name, "offsets": offsets, "bytes": sum(sizes), "seq": self._seq}

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Copy the data into the reserved segment, then mark it ready."""
        if dst not in self._pending:
            return
        seg, offsets, seq = self._pending.pop(dst)
        data = torch.from_numpy(np.ndarray((seg.capacity,), np.uint8, seg.shm.buf, _HEADER))
        for t, off in zip(tensors, offsets):
            t = t.detach().cpu().reshape(-1)
            nbytes = t.numel() * t.element_size()
            # same-dtype copy (a plain memcpy, faster than bytewise); offsets are aligned
            data[off : off + nbytes].view(t.dtype).copy_(t)
        _fence()
        seg.words[_READY] = seq

    # ---- receiver --------------------------------------------------------------------

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        if payload is None:
            return [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in specs]
        name = payload["segment"]
        seg = self._attached.get(name)
        if seg is None:
            seg = self._attached[name] = _Segment(_Attached(name), owner=False)
        self._wait_ready(seg, payload["seq"], src)
        region = np.ndarray((payload["bytes"],), np.uint8, seg.shm.buf, _HEADER)
        weakref.finalize(region, _release, seg.words)  # when the last view below is freed
        base = torch.from_numpy(region)  # keeps `region` alive as long as its storage
        return [
            from_bytes(base[off : off + s.nbytes], s).to(device)
            for s, off in zip(specs, payload["offsets"])
        ]

    def _wait_ready(self, seg: _Segment, seq: int, src: int) -> None:
        start, spins = time.monotonic(), 0
        while seg.words[_READY] != seq:
            spins += 1
            if spins > 1000:
                time.sleep(0.00005)
                if time.monotonic() - start > self.timeout_s:
                    raise TimeoutError(
                        f"shm transfer from side rank {src}: data not written after "
                        f"{self.timeout_s:.0f}s (did the sender die?)"
                    )
        _fence()

    def close(self) -> None:
        for pool in self._pools.values():
            for seg in pool:
                seg.close()
        self._pools.clear()
        for seg in self._attached.values():
            seg.close()
        self._attached.clear()


def _release(words: np.ndarray) -> None:
    words[_BUSY] = 0
