"""Host memory of a worker: heap fragmentation, and the bytes autograd keeps for backward."""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch

_M_MMAP_THRESHOLD = -3


def limit_heap_fragmentation(threshold: int = 1 << 16) -> bool:
    """Serve every allocation above ``threshold`` bytes with its own mmap (returned to the
    OS on free). glibc otherwise raises its mmap threshold after large frees, so later
    tensors come from the heap, which fragments and does not shrink: measured here, a
    150M-parameter FSDP2 shard's RSS grew by ~400 MB per step without it and stayed flat
    with it. Returns whether it applied (glibc on Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def saved_activation_bytes(module: torch.nn.Module):
    """Counts, into the yielded one-item list, the bytes of distinct tensors that autograd
    saves for backward inside the block, excluding ``module``'s parameters."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
