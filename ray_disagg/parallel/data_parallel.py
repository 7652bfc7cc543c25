"""Data parallelism: sum gradients over the ``"dp"`` process group.

Each replica's loss is already ``sum(token losses) / global label tokens``, so the global
gradient is the plain SUM of the replicas' gradients (not the mean).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["all_reduce_gradients", "ensure_grads"]

_BUCKET_ELEMS = 1 << 24


def ensure_grads(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Give every trainable parameter a gradient (zeros if backward did not reach it), so
    all ranks take part in the same collectives even when one had no images."""
    out = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (dp replicas reduce their own tp shards)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _buckets(grads: list[torch.Tensor]):
    bucket, size = [], 0
    for g in grads:
        if bucket and size + g.numel() > _BUCKET_ELEMS:
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        yield bucket


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """In-place SUM all-reduce of the gradients over ``group``, in flat buckets.

    A parameter that got no gradient on any rank of ``group`` (e.g. the vision tower in a
    step whose batch has no image) keeps ``grad=None``, so the optimizer skips it, as
    single-process training does."""
    params = [p for p in params if p.requires_grad]
    if not params:  # a frozen group (and no CPU tensor for an NCCL-only group)
        return
    device = params[0].device
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(had, group=group)
    grads = [_local(p.grad) for p in ensure_grads(params)]
    if dist.get_world_size(group) > 1:
        _sum_in_buckets(grads, group)
    for p, h in zip(params, had.tolist()):
        if not h:
            p.grad = None


def _sum_in_buckets(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
