"""Same-GPU tier: the header carries CUDA IPC handles of the sender's tensors (torch's own
CUDA tensor reduction, ``reduce_tensor``: the allocator segment's memory handle, the
storage's offset in it, a ref-count slot and an interprocess event the sender recorded on
its current stream). The receiver copies device to device; nothing goes through the host
but the handles.

Ordering, with CUDA events only (no stream or device synchronization on either side):

- receiver: ``_new_shared_cuda`` makes the receiver's current stream wait on the sender's
  event (``cudaStreamWaitEvent``), the copy is queued on that stream, then the receiver
  records its own interprocess "copy done" event (one per sender) and sends the event's
  IPC handle back over gloo as the message's acknowledgement (posted, not waited on);
- sender: ``after_header`` posts the receive of that acknowledgement next to the header,
  so it usually has arrived when the handle's ``wait()`` is called. ``wait()`` then makes
  the sender's current stream wait on the receiver's event: work queued afterwards (an
  in-place update, or the allocator reusing a freed buffer on that stream) runs after the
  receiver's copy. The host blocks only until the receiver has queued its copy, never
  until the GPU finished it. The event is re-recorded for each message; a wait that sees a
  later record only waits longer.

Mappings: opening a segment (``cudaIpcOpenMemHandle``) is costly, and torch closes it as
soon as no storage built from it is alive. The receiver keeps a small "anchor" storage per
(sender, segment handle) -- an LRU of ``max_segments`` -- so later messages in the same
segment reuse the mapping (torch's allocator caches the device pointer per handle while a
storage holds it). The anchor carries no ref-count slot: it pins no memory of the sender,
and reads nothing. Python's ``rebuild_cuda_tensor`` is not used for the per-message
storages because its cache hit path skips the wait on the sender's event.

Releasing a received storage makes torch synchronize the current stream and then release
the sender's ref-count slot (after which the sender's allocator may reuse the block). The
receiver keeps each message's storages until a plain event recorded after its copy has
completed (polled, never waited on, at the next message) and frees them with an idle
private stream current, so that synchronization returns at once.

Processes may number the same GPU differently (``CUDA_VISIBLE_DEVICES``), so the device
travels as its UUID and the receiver maps it to its own index."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ray_disagg.transport.base import TensorSpec

__all__ = ["CudaIpcTier"]

# rebuild_cuda_tensor's parameters, in order (tests check them against torch's signature)
_PARAMS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
# the arguments rebuild_cuda_tensor passes to UntypedStorage._new_shared_cuda, in order
_SHARED_CUDA_ARGS = (
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_DEVICE_ARG = 6  # position of the storage's device index in rebuild_cuda_tensor's arguments
_ACK_TAG = 7  # gloo tag of the acknowledgements (headers and data use tag 0)
_ACK_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
_NO_COUNTER = b""  # anchors hold no ref-count slot (torch's release of it is best effort)


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def named_args(args) -> dict:
    """``rebuild_cuda_tensor``'s arguments by parameter name."""
    if len(args) != len(_PARAMS):
        raise RuntimeError(
            f"cuda_ipc: torch's CUDA tensor reduction gave {len(args)} arguments, expected "
            f"{len(_PARAMS)}; this torch version is not supported by the cuda_ipc tier "
            "(set transfer='nccl' or 'gloo')."
        )
    return dict(zip(_PARAMS, args))


class _Ack:
    """The sender's side of one message's acknowledgement: the receiver's event handle."""

    def __init__(self, tier: CudaIpcTier, work, buf: torch.Tensor, device: torch.device):
        self.tier, self.work, self.buf, self.device = tier, work, buf, device

    def wait(self) -> None:
        self.work.wait()  # bounded by the link's timeout
        event = self.tier._peer_event(self.device, bytes(self.buf.numpy()))
        torch.cuda.current_stream(self.device).wait_event(event)


class CudaIpcTier:
    """CUDA IPC between processes that share a GPU (colocated workers)."""

    name = "cuda_ipc"

    def __init__(self, route, max_segments: int = 64):
        # route(peer): the gloo group of the link with the peer and its rank in it
        self.route, self.max_segments = route, max_segments
        self._index_of: dict[str, int] = {}
        self._peer_events: dict[bytes, torch.cuda.Event] = {}  # sender: opened ack events
        self._done: dict[int, torch.cuda.Event] = {}  # receiver: ack event per sender
        self._anchors: OrderedDict = OrderedDict()  # receiver: (src, handle) -> storage
        self._inflight: list[tuple[torch.cuda.Event, list]] = []  # receiver: to release
        self._acks: list = []  # receiver: posted acknowledgements
        self._idle: dict[int, torch.cuda.Stream] = {}

    # ---- sender ----------------------------------------------------------------------

    def pack(self, tensors: list[torch.Tensor], dst: int):
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"cuda_ipc carries CUDA tensors, got one on {t.device}")
            # records an interprocess event on the current stream; torch keeps the block
            # out of the allocator until the receiver released its ref-count slot
            _rebuild, args = reduce_tensor(t.detach())
            args = list(args)
            args[_DEVICE_ARG] = _uuid(args[_DEVICE_ARG])
            out.append(tuple(args))
        return out

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        if not tensors:
            return []
        buf = torch.zeros(_ACK_BYTES, dtype=torch.uint8)
        pg, rank = self.route(dst)
        work = pg.recv([buf], rank, _ACK_TAG)
        return [(_Ack(self, work, buf, tensors[0].device), buf)]

    def _peer_event(self, device: torch.device, handle: bytes) -> torch.cuda.Event:
        if handle not in self._peer_events:
            self._peer_events[handle] = torch.cuda.Event.from_ipc_handle(device, handle)
        return self._peer_events[handle]

    # ---- receiver --------------------------------------------------------------------

    def _local_index(self, uuid: str) -> int:
        if uuid not in self._index_of:
            for i in range(torch.cuda.device_count()):
                self._index_of[_uuid(i)] = i
        if uuid not in self._index_of:
            raise RuntimeError(f"cuda_ipc: GPU {uuid} is not visible to this process")
        return self._index_of[uuid]

    def _anchor(self, src: int, a: dict, index: int) -> None:
        """Keep the segment mapped while later messages use it (LRU)."""
        key = (src, a["storage_handle"])
        if key in self._anchors:
            self._anchors.move_to_end(key)
            return
        self._anchors[key] = torch.UntypedStorage._new_shared_cuda(
            index, a["storage_handle"], 1, a["storage_offset_bytes"], _NO_COUNTER, 0, b"", False
        )
        while len(self._anchors) > self.max_segments:
            with torch.cuda.stream(self._idle_stream(index)):
                self._anchors.popitem(last=False)

    def _open(self, src: int, a: dict, index: int):
        """A view of the sender's tensor, ordered after the sender's event on the current
        stream; returns ``(view, storage)``."""
        if a["storage_handle"] is None or a["storage_size_bytes"] == 0:
            view = torch.empty(a["tensor_size"], dtype=a["dtype"], device=f"cuda:{index}")
            return view, None
        self._anchor(src, a, index)
        args = [index if k == "storage_device" else a[k] for k in _SHARED_CUDA_ARGS]
        storage = torch.UntypedStorage._new_shared_cuda(*args)
        view = torch.empty(0, dtype=a["dtype"], device=f"cuda:{index}")
        view.set_(storage, a["tensor_offset"], a["tensor_size"], a["tensor_stride"])
        return view, storage

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        self._reap()
        if not payload:
            return []
        out, storages, index = [], [], None
        for args in payload:
            a = named_args(args)
            index = self._local_index(a["storage_device"])
            with torch.cuda.device(index):
                view, storage = self._open(src, a, index)
                out.append(view.to(device, copy=True))
            storages.append(storage)
            del view  # the storages list holds the mapping until the copy completed
        with torch.cuda.device(index):
            stream = torch.cuda.current_stream(index)
            copied = torch.cuda.Event()
            copied.record(stream)
            self._inflight.append((copied, storages))
            self._acknowledge(src, index, stream)
        return out

    def _acknowledge(self, src: int, index: int, stream) -> None:
        done = self._done.get(src)
        if done is None:
            done = self._done[src] = torch.cuda.Event(interprocess=True)
        done.record(stream)
        buf = torch.frombuffer(bytearray(done.ipc_handle()), dtype=torch.uint8)
        pg, rank = self.route(src)
        self._acks.append((pg.send([buf], rank, _ACK_TAG), buf))
        self._acks = [(w, b) for w, b in self._acks if not w.is_completed()]

    def _idle_stream(self, index: int) -> torch.cuda.Stream:
        if index not in self._idle:
            self._idle[index] = torch.cuda.Stream(index)
        return self._idle[index]

    def _reap(self, wait: bool = False) -> None:
        """Free the storages of messages whose copy has completed (all of them, waiting
        for each copy, with ``wait``)."""
        keep = []
        for copied, storages in self._inflight:
            if wait:
                copied.synchronize()
            if not copied.query():
                keep.append((copied, storages))
                continue
            live = [s for s in storages if s is not None]
            if live:
                with torch.cuda.stream(self._idle_stream(live[0].device.index)):
                    storages.clear()
                    del live
        self._inflight = keep

    def close(self, abort: bool = False) -> None:
        """Release every mapping (after the pending copies completed; with ``abort``, a
        failed peer's, without waiting: its copies may never complete)."""
        self._reap(wait=not abort)
        while self._anchors:
            index = next(iter(self._anchors.values())).device.index
            with torch.cuda.stream(self._idle_stream(index)):
                self._anchors.popitem(last=False)  # freed here, with an idle stream current
        self._acks.clear()
        self._peer_events.clear()
