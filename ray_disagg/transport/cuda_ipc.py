"""Same-GPU tier: the header carries CUDA IPC handles of the sender's tensors (torch's
own CUDA tensor reduction: memory handle, offset, ref-count handle and an interprocess
event). The receiver opens them, waits on the event, copies device to device and
releases the handles; nothing goes through the host but the handles.

Processes may number the same GPU differently (``CUDA_VISIBLE_DEVICES``), so the device
travels as its UUID and the receiver maps it to its own index."""

from __future__ import annotations

import torch

from ray_disagg.transport.base import TensorSpec

__all__ = ["CudaIpcTier"]

_DEVICE_ARG = 6  # position of the storage's device index in rebuild_cuda_tensor's arguments


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcTier:
    """CUDA IPC between processes that share a GPU (colocated workers)."""

    name = "cuda_ipc"

    def __init__(self):
        self._index_of: dict[str, int] = {}

    def pack(self, tensors: list[torch.Tensor], dst: int):
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"cuda_ipc carries CUDA tensors, got one on {t.device}")
            # torch keeps the storage alive until the receiver has released its handle
            rebuild, args = reduce_tensor(t.detach())
            args = list(args)
            args[_DEVICE_ARG] = _uuid(args[_DEVICE_ARG])
            out.append((rebuild, tuple(args)))
        return out

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        return []

    def _local_index(self, uuid: str) -> int:
        if uuid not in self._index_of:
            for i in range(torch.cuda.device_count()):
                self._index_of[_uuid(i)] = i
        if uuid not in self._index_of:
            raise RuntimeError(f"cuda_ipc: GPU {uuid} is not visible to this process")
        return self._index_of[uuid]

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        shared = []
        for rebuild, args in payload:  # views of the sender's memory (after its event)
            args = list(args)
            args[_DEVICE_ARG] = self._local_index(args[_DEVICE_ARG])
            shared.append(rebuild(*args))
        out = [t.to(device, copy=True) for t in shared]
        # the copies must finish before the handles (and the sender's memory) are released
        for t in shared:
            torch.cuda.current_stream(t.device).synchronize()
        del shared
        return out
