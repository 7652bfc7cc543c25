"""Host memory of a worker: heap fragmentation, per-step peak memory, and the bytes
autograd keeps for backward."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys

import torch

_M_MMAP_THRESHOLD = -3


@functools.cache
def _libc():
    """glibc, or None (another platform or C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def limit_heap_fragmentation(threshold: int = 16 << 20) -> bool:
    """Serve every allocation above ``threshold`` bytes (16 MiB) with its own mmap,
    returned to the OS on free, and keep the threshold fixed: glibc otherwise raises it
    after large frees (up to 32 MiB), so later tensors come from the heap, which fragments
    and does not shrink (a 150M-parameter FSDP2 shard's RSS grew ~400 MB per step).
    Measured (benchmarks/memory.py, FSDP2 case, 10 steps): the step peak stays flat
    (step 3 -> 10: -0.3%). A 64 KiB threshold also kept it flat but made every mid-sized
    tensor pay fresh page faults (a CPU step took 1.6-2.2x the single-process step), and
    ``malloc_trim`` after every step cost as much (1.63x); 16 MiB alone: 0.99x.
    glibc's own ``MALLOC_MMAP_THRESHOLD_`` environment variable, when set, wins (e.g.
    1 MiB for tiny models, whose activations are 1-16 MB heap blocks: their RSS then
    follows the live tensors as a large model's does, at ~20% more CPU step time).
    Returns whether it applied (glibc on Linux only)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory (MB) since the last :func:`reset_peak_memory` (else since the process
    started): GPU memory allocated on CUDA; the resident set size's high-water mark
    (``VmHWM``) of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    import resource  # no /proc (not Linux): the lifetime peak

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start a new window for :func:`peak_memory_mb`: on CUDA the allocator's peak
    statistics; on CPU the process's ``VmHWM`` (set to the current resident set size by
    writing 5 to ``/proc/self/clear_refs``, Linux >= 4.0)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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
