"""Same-GPU tier: the header carries CUDA IPC handles of the sender's tensors (torch's
own CUDA tensor reduction: memory handle, offset, ref-count handle and an interprocess
event). The receiver opens them, waits on the event, copies device to device and
releases the handles; nothing goes through the host but the handles."""

from __future__ import annotations

import io
import pickle

import torch

from ray_disagg.transport.base import TensorSpec

__all__ = ["CudaIpcTier"]


class CudaIpcTier:
    """CUDA IPC between processes that share a GPU (colocated workers)."""

    name = "cuda_ipc"

    def __init__(self):
        import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

    def pack(self, tensors: list[torch.Tensor], dst: int):
        from multiprocessing.reduction import ForkingPickler

        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"cuda_ipc carries CUDA tensors, got one on {t.device}")
        buf = io.BytesIO()
        # torch keeps each storage alive until the receiver has released its handle
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump([t.detach() for t in tensors])
        return buf.getvalue()

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> None:
        pass

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        shared = pickle.loads(payload)  # rebuilds views of the sender's memory
        out = [t.to(device, copy=True) for t in shared]
        # the copies must finish before the handles (and the sender's memory) are released
        torch.cuda.current_stream(device).synchronize()
        del shared
        return out
