"""The whole sequence from the context-parallel slices and back, with gradients.

A layer that cannot run on a slice of the sequence (a recurrence along it) runs on the
whole sequence split by heads instead (Qwen3.5's Gated DeltaNet,
:mod:`ray_disagg.models.qwen3_5.context`): :class:`GatherSequence` all-gathers the ``cp``
ranks' slices ``(B, s_r, ...)`` into ``(B, S, ...)``, and :class:`ScatterSequence`
sums the ranks' partial results ``(B, S, ...)`` (each over its own heads) and hands each
rank its slice. Each is the other's backward. The slices are contiguous and in rank
order (``seq_lens``, as :func:`~ray_disagg.parallel.context_parallel.slice_bounds`
makes them: unequal by at most one); they travel padded to the longest, so every rank
sends and receives the same sizes. The sizes are host integers: no device sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["GatherSequence", "ScatterSequence", "gather_sequence", "scatter_sequence"]


def gather_sequence(x: torch.Tensor, seq_lens: list[int], group) -> torch.Tensor:
    """``x`` ``(B, s_r, ...)`` (this rank's slice) -> ``(B, S, ...)``: every rank's slice
    concatenated along dim 1 in rank order (one all-gather over ``group``)."""
    n, width = len(seq_lens), max(seq_lens)
    pad = [0, 0] * (x.dim() - 2) + [0, width - x.shape[1]]
    sent = F.pad(x, pad).contiguous()
    got = sent.new_empty((n * sent.shape[0], *sent.shape[1:]))  # gloo: concatenated on dim 0
    dist.all_gather_single(got, sent, group=group)
    got = got.view(n, *sent.shape)
    if all(s == width for s in seq_lens):
        return got.transpose(0, 1).reshape(x.shape[0], n * width, *x.shape[2:])
    return torch.cat([got[j, :, :s] for j, s in enumerate(seq_lens)], dim=1)


def scatter_sequence(x: torch.Tensor, seq_lens: list[int], rank: int, group) -> torch.Tensor:
    """``x`` ``(B, S, ...)`` (this rank's partial sums) -> ``(B, s_rank, ...)``: this
    rank's slice of the sum over ``group`` (one reduce-scatter)."""
    n, width = len(seq_lens), max(seq_lens)
    if all(s == width for s in seq_lens):
        sent = x.reshape(x.shape[0], n, width, *x.shape[2:]).transpose(0, 1).contiguous()
    else:
        sent = x.new_zeros((n, x.shape[0], width, *x.shape[2:]))
        start = 0
        for j, s in enumerate(seq_lens):
            sent[j, :, :s] = x[:, start : start + s]
            start += s
    got = sent.new_empty(sent.shape[1:])
    dist.reduce_scatter_single(got, sent.flatten(0, 1), group=group)
    return got[:, : seq_lens[rank]]


class GatherSequence(torch.autograd.Function):
    """Forward: ``(B, s_r, ...)`` on each rank of ``group`` -> ``(B, S, ...)`` on every
    rank (:func:`gather_sequence`; ``S = sum(seq_lens)``). Backward: the gradient
    ``(B, S, ...)`` of each rank (a partial, e.g. through its heads only) summed over the
    ranks and cut to this rank's slice (:func:`scatter_sequence`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seq_lens: list[int], rank: int, group) -> torch.Tensor:
        ctx.seq_lens, ctx.rank, ctx.group = seq_lens, rank, group
        return gather_sequence(x, seq_lens, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return scatter_sequence(grad, ctx.seq_lens, ctx.rank, ctx.group), None, None, None


class ScatterSequence(torch.autograd.Function):
    """Forward: ``(B, S, ...)`` partial sums on each rank of ``group`` -> ``(B, s_r, ...)``,
    this rank's slice of their sum (:func:`scatter_sequence`). Backward: the slices'
    gradients all-gathered into ``(B, S, ...)`` (:func:`gather_sequence`): every rank's
    partial enters the sum with coefficient 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seq_lens: list[int], rank: int, group) -> torch.Tensor:
        ctx.seq_lens, ctx.group = seq_lens, group
        return scatter_sequence(x, seq_lens, rank, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_sequence(grad, ctx.seq_lens, ctx.group), None, None, None
