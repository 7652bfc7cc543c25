"""Same-node CPU tier: the sender copies a message's tensors once into a shared-memory
buffer; the receiver maps that buffer and hands out tensors that view it (no socket copy,
no second copy).

Each sender keeps a small pool of segments per receiver. A segment starts with two words:
``busy``, set by the sender when it reserves the segment and cleared by the receiver when
the last tensor viewing the segment is freed (a finalizer on the storage's owner), and
``ready``, the sequence number of the message whose data is complete. On x86 (stores are
seen in program order) the header goes out over gloo before the copy, so the receiver
wakes up while the sender copies and then waits for ``ready``; elsewhere the sender copies
first.

No segment outlives the run: the receiver removes a segment's name as soon as it has
mapped it (the memory goes with the last mapping), the sender removes names not yet
mapped when it closes, and a new tier removes segments left by senders that died before
their receiver mapped them.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import platform
import secrets
import time
import weakref

import numpy as np
import torch

from ray_disagg.transport.base import TensorSpec, from_bytes

__all__ = ["ShmTier", "ShmUnavailable"]

logger = logging.getLogger(__name__)

_DIR = "/dev/shm"
_PREFIX = "rdshm"
_HEADER = 64  # bytes before the data: busy and ready (int64 each); cache-line aligned data
_ALIGN = 64
_BUSY, _READY = 0, 1
# header before the copy only where stores become visible in program order (TSO)
_OVERLAP = platform.machine().lower() in ("x86_64", "amd64", "i686")


class ShmUnavailable(OSError):
    """The shared-memory buffer could not be created (e.g. /dev/shm is full)."""


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Segment:
    """One mapped segment; ``words`` and every data view hold the mapping's buffer, so it
    is unmapped only once none is left."""

    def __init__(self, name: str, size: int | None = None):
        create = size is not None
        path = os.path.join(_DIR, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                try:  # reserve the pages: a full /dev/shm is an error here, not a SIGBUS later
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.unlink(path)
                    raise ShmUnavailable(
                        f"/dev/shm has no room for {size / 2**20:.1f} MiB ({e}); enlarge it "
                        "(docker --shm-size) or set transfer='gloo'"
                    ) from e
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name, self.path, self.linked = name, path, create
        self.words = np.frombuffer(self._mmap, dtype=np.int64, count=2)
        self.capacity = self.size - _HEADER

    @property
    def busy(self) -> bool:
        return bool(self.words[_BUSY])

    def data(self, nbytes: int) -> np.ndarray:
        return np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=_HEADER)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):  # the receiver removed it
                os.unlink(self.path)

    def close(self) -> None:
        """Sender side: remove the name and unmap (views left, if any, keep it mapped)."""
        self.unlink()
        self.words = None
        with contextlib.suppress(BufferError):  # still viewed: unmapped with the last view
            self._mmap.close()


def _sweep_dead_senders(min_age_s: float = 60.0) -> None:
    """Remove segments whose sender process is gone (it died before they were mapped)."""
    now = time.time()
    for path in glob.glob(os.path.join(_DIR, f"{_PREFIX}*_*")):
        pid = os.path.basename(path)[len(_PREFIX) :].split("_")[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and now - os.stat(path).st_mtime > min_age_s:
                try:
                    os.kill(int(pid), 0)
                except ProcessLookupError:
                    os.unlink(path)


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
        self._tag = f"{_PREFIX}{os.getpid()}_{secrets.token_hex(3)}"
        self._made = self._seq = 0
        self._pools: dict[int, list[_Segment]] = {}  # sender: per receiver
        self._pending: dict[int, tuple] = {}  # sender: reserved, data not yet written
        self._retired: dict[int, list[str]] = {}  # sender: replaced, receiver not told yet
        self._attached: dict[str, _Segment] = {}  # receiver: by name
        self.interrupted = False  # set from another thread: a peer's group failed
        _sweep_dead_senders()

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
                    self._retired.setdefault(dst, []).append(free[0].name)
                self._made += 1
                size = _HEADER + max(self.min_bytes, 1 << (nbytes - 1).bit_length())
                seg = _Segment(f"{self._tag}_{self._made}", size)
                pool.append(seg)
                return seg
            if self.interrupted or time.monotonic() - start > self.timeout_s:
                raise TimeoutError(
                    f"shm transfer to side rank {dst}: all {len(pool)} buffers still held by "
                    f"the receiver after {time.monotonic() - start:.0f}s (did it die?)"
                )
            time.sleep(0.0005)

    def pack(self, tensors: list[torch.Tensor], dst: int):
        """Reserve a segment and lay the message out; the data is written here, or (x86)
        in :meth:`after_header` once the header is on its way."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        if not sum(sizes):
            return None
        seg = self._segment_for(sum(sizes), dst)
        seg.words[_BUSY], seg.words[_READY] = 1, 0
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._seq += 1
        self._pending[dst] = (seg, offsets, self._seq)
        if not _OVERLAP:
            self.after_header(tensors, dst)
        return {
            "segment": seg.name,
            "offsets": offsets,
            "bytes": sum(sizes),
            "seq": self._seq,
            "retired": self._retired.pop(dst, []),
        }

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        """Copy the data into the reserved segment, then mark it ready."""
        if dst not in self._pending:
            return []
        seg, offsets, seq = self._pending.pop(dst)
        try:
            data = torch.from_numpy(seg.data(seg.capacity))
            for t, off in zip(tensors, offsets):
                t = t.detach().cpu().reshape(-1)
                nbytes = t.numel() * t.element_size()
                # same-dtype copy (a plain memcpy, faster than bytewise); offsets are aligned
                data[off : off + nbytes].view(t.dtype).copy_(t)
        except BaseException:
            seg.words[_BUSY] = 0
            raise
        seg.words[_READY] = seq
        return []

    # ---- receiver --------------------------------------------------------------------

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        if payload is None:
            return [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in specs]
        self.forget(payload["retired"])
        name = payload["segment"]
        seg = self._attached.get(name)
        if seg is None:
            seg = self._attached[name] = _Segment(name)
            seg.linked = True
            seg.unlink()  # mapped on both sides now: the name is no longer needed
        self._wait_ready(seg, payload["seq"], src)
        region = seg.data(payload["bytes"])
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
                if self.interrupted or time.monotonic() - start > self.timeout_s:
                    raise TimeoutError(
                        f"shm transfer from side rank {src}: data not written after "
                        f"{time.monotonic() - start:.0f}s (did the sender die?)"
                    )

    def forget(self, names) -> None:
        """Receiver: drop mappings of segments the sender replaced (unmapped once no
        tensor views them)."""
        for name in names:
            self._attached.pop(name, None)

    def interrupt(self, peers) -> None:
        """Make every wait of this tier give up now (from any thread): a group failed."""
        self.interrupted = True

    def close(self, abort: bool = False) -> None:
        """Remove this sender's segment names and unmap what nothing views any more.
        Received tensors stay valid (they hold their own mapping)."""
        for pool in self._pools.values():
            for seg in pool:
                seg.close()
        self._pools.clear()
        self._attached.clear()


def _release(words: np.ndarray) -> None:
    words[_BUSY] = 0
