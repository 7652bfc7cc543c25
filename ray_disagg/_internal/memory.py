"""Activation memory: bytes autograd keeps for backward, parameters excluded."""

from __future__ import annotations

import contextlib

import torch


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
