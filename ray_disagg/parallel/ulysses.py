"""Ulysses sequence parallelism for any vision tower, through its unmodified HF forward.

Each of the ``sp`` ranks of a data-parallel replica holds a contiguous slice of the
replica's patch sequence, in the order the tower attends in (its :class:`TowerPlan`
decides: natural order, or a windowed order), cut only where the family's plan allows
(merge units; whole windows where windowed blocks must stay local). The tower runs on the
slice with precomputed per-slice kwargs (positions, windows, interpolation taps) and
``config._attn_implementation = "ray_disagg_ulysses"``: an attention function registered
in ``transformers.AttentionInterface`` that, in full-attention blocks, swaps sequence and
heads with an all-to-all (:class:`SeqToHeads`), attends per image/frame over the whole
sequence and swaps back (:class:`HeadsToSeq`); other blocks attend locally with SDPA.
Every output the plan names (the merged embeddings first) is gathered to SP rank 0
(:class:`GatherToLeader`), which restores the token order.

The slice of one call lives in a :class:`UlyssesContext` that :func:`sp_tower_forward`
creates and hands to the tower's forward as the ``ulysses`` keyword; HF passes it on to
every block and attention call, and activation checkpointing recomputes a block with the
keywords of its own forward, so each microbatch's backward sees its own slice with
nothing kept on the tower between calls.

Slices may be uneven and empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SeqToHeads",
    "HeadsToSeq",
    "GatherToLeader",
    "HostRows",
    "SliceLayout",
    "TowerPlan",
    "UlyssesContext",
    "enable_ulysses",
    "plan_slices",
    "sp_tower_forward",
]

ATTN_IMPLEMENTATION = "ray_disagg_ulysses"


def _all_to_all(
    x: torch.Tensor, in_splits: list[int], out_splits: list[int], group
) -> torch.Tensor:
    out = x.new_empty(sum(out_splits))
    dist.all_to_all_single(out, x.contiguous().reshape(-1), out_splits, in_splits, group=group)
    return out


class SeqToHeads(torch.autograd.Function):
    """Forward: ``(s_local, H, d)`` -> ``(S, H / n, d)``: scatter heads, gather the sequence
    (``S`` = sum of all ranks' ``s_local``, concatenated in rank order).
    Backward: the inverse all-to-all (:class:`HeadsToSeq`) of the gradient."""

    @staticmethod
    def forward(ctx, x, seq_lens: list[int], rank: int, group):
        ctx.seq_lens, ctx.rank, ctx.group = seq_lens, rank, group
        return _seq_to_heads(x, seq_lens, rank, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.seq_lens, ctx.rank, ctx.group), None, None, None


class HeadsToSeq(torch.autograd.Function):
    """Forward: ``(S, H / n, d)`` -> ``(s_local, H, d)``: scatter the sequence, gather heads.
    Backward: :class:`SeqToHeads` of the gradient."""

    @staticmethod
    def forward(ctx, x, seq_lens: list[int], rank: int, group):
        ctx.seq_lens, ctx.rank, ctx.group = seq_lens, rank, group
        return _heads_to_seq(x, seq_lens, rank, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.seq_lens, ctx.rank, ctx.group), None, None, None


def _seq_to_heads(x, seq_lens, rank, group):
    n = len(seq_lens)
    s_local, heads, d = x.shape
    hn = heads // n
    # chunk j (this rank's tokens, head group j) goes to rank j
    send = x.reshape(s_local, n, hn, d).permute(1, 0, 2, 3)
    out = _all_to_all(send, [s_local * hn * d] * n, [s * hn * d for s in seq_lens], group)
    return out.view(sum(seq_lens), hn, d)


def _heads_to_seq(x, seq_lens, rank, group):
    n = len(seq_lens)
    _, hn, d = x.shape
    s_local = seq_lens[rank]
    out = _all_to_all(x, [s * hn * d for s in seq_lens], [s_local * hn * d] * n, group)
    # received from rank j: (s_local, hn, d) of head group j
    return out.view(n, s_local, hn, d).permute(1, 0, 2, 3).reshape(s_local, n * hn, d)


class GatherToLeader(torch.autograd.Function):
    """Forward: ``(s_local, D)`` on each rank -> ``(S, D)`` on rank 0 (``(0, D)`` elsewhere).
    Backward: rank 0 scatters the gradient's slices back to their ranks."""

    @staticmethod
    def forward(ctx, x, seq_lens: list[int], rank: int, group):
        ctx.seq_lens, ctx.rank, ctx.group, ctx.dim = seq_lens, rank, group, x.shape[1]
        n, d = len(seq_lens), x.shape[1]
        in_splits = [x.shape[0] * d if j == 0 else 0 for j in range(n)]
        out_splits = [s * d for s in seq_lens] if rank == 0 else [0] * n
        out = _all_to_all(x, in_splits, out_splits, group)
        return out.view(-1, d)

    @staticmethod
    def backward(ctx, grad):
        n, d = len(ctx.seq_lens), ctx.dim
        in_splits = [s * d for s in ctx.seq_lens] if ctx.rank == 0 else [0] * n
        out_splits = [ctx.seq_lens[ctx.rank] * d if j == 0 else 0 for j in range(n)]
        out = _all_to_all(grad, in_splits, out_splits, ctx.group)
        return out.view(-1, d), None, None, None


@dataclass(frozen=True)
class SliceLayout:
    """Rank ``r`` holds sequence positions ``[bounds[r], bounds[r + 1])``."""

    bounds: tuple[int, ...]

    @property
    def seq_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def plan_slices(cuts: list[int], sp_size: int) -> SliceLayout:
    """Cut a sequence into ``sp_size`` contiguous runs at allowed positions ``cuts``
    (ascending, from 0 to the length), each cut closest to an equal share."""
    total = cuts[-1]
    bounds = [0]
    for r in range(1, sp_size):
        target = total * r / sp_size
        # ties go to the later cut, so that lower ranks (and the leader) are never emptier
        best = min((c for c in cuts if c >= bounds[-1]), key=lambda c: (abs(c - target), -c))
        bounds.append(best)
    bounds.append(total)
    return SliceLayout(tuple(bounds))


class TowerPlan:
    """How one family's tower is cut for Ulysses (subclassed by the family adapters): which
    modules attend over whole images, the attention order, the allowed cuts, the per-slice
    forward kwargs and which output tensors to gather."""

    def merge_unit(self, tower) -> int:
        """Input rows merged into one output row (slices are cut on multiples of it)."""
        raise NotImplementedError

    def outputs(self, out: Any) -> list[torch.Tensor]:
        """The ``(rows, D)`` tensors of the tower's output, the merged embeddings first."""
        raise NotImplementedError

    def full_attention_modules(self, tower) -> list[torch.nn.Module]:
        """Attention modules that attend over whole images (all-to-all under SP)."""
        raise NotImplementedError

    def order(self, tower, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """Patch permutation into attention order, or ``None`` for the natural order."""
        return None

    def cuts(self, tower, grid_thw: torch.Tensor) -> list[int]:
        """Allowed slice boundaries in attention order (default: every merge unit)."""
        total = int(grid_thw.prod(-1).sum())
        return list(range(0, total + 1, self.merge_unit(tower)))

    def full_cu_seqlens(self, tower, grid_thw: torch.Tensor) -> torch.Tensor:
        """Per image/frame boundaries of the whole sequence, in attention order."""
        raise NotImplementedError

    def local_kwargs(self, tower, grid_thw, index: torch.Tensor, lo: int, hi: int) -> dict:
        """Precomputed kwargs of the tower's forward for the slice ``[lo, hi)`` holding the
        patches ``index`` (positions in attention order)."""
        raise NotImplementedError

    def restore(self, tower, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """Row index that puts the gathered merged tokens back in token order."""
        return None


@dataclass(frozen=True, kw_only=True)
class UlyssesContext:
    """The slice of one :func:`sp_tower_forward` call (one microbatch), read by
    :func:`ulysses_attention` in that call's forward and in its recomputation."""

    group: dist.ProcessGroup
    """The SP process group."""
    rank: int
    """This rank in ``group``."""
    seq_lens: tuple[int, ...]
    """Patches of each rank's slice (rank order)."""
    segments: tuple[int, ...]
    """Patches of each image/frame of the whole sequence, in attention order (host
    integers, computed once per call: attention never reads them back from the device)."""
    full_attention: frozenset[int]
    """``id`` of the attention modules that attend over the whole sequence."""
    stand_in: int = 0
    """Rows of a stand-in slice on a rank whose real slice is empty (0: none)."""


def ulysses_attention(
    module, query, key, value, attention_mask, scaling=None, ulysses=None, **kwargs
):
    """``AttentionInterface`` function: ``query/key/value`` ``(1, H, s_local, d)`` ->
    ``(1, s_local, H, d)``. Under SP (``ulysses``: the call's :class:`UlyssesContext`),
    full-attention modules gather the sequence with an all-to-all and attend per segment
    of the whole sequence; other modules, and calls without a context, run plain SDPA."""
    sp: UlyssesContext | None = ulysses
    if sp is None or id(module) not in sp.full_attention:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    seq_lens = list(sp.seq_lens)
    # (s, H, d); a stand-in slice sends nothing (its rows are dropped after the tower)
    q, k, v = (
        t.squeeze(0).transpose(0, 1)[: t.shape[2] - sp.stand_in] for t in (query, key, value)
    )
    q, k, v = (SeqToHeads.apply(t.contiguous(), seq_lens, sp.rank, sp.group) for t in (q, k, v))
    outs = []
    for qi, ki, vi in zip(*(t.split(list(sp.segments), dim=0) for t in (q, k, v))):
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi))
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scaling)
        outs.append(o.squeeze(0).transpose(0, 1))
    attn = torch.cat(outs, dim=0) if outs else q
    attn = HeadsToSeq.apply(attn.contiguous(), seq_lens, sp.rank, sp.group)
    if sp.stand_in:
        attn = torch.cat([attn, attn.new_zeros(sp.stand_in, *attn.shape[1:])])
    return attn.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention)


def enable_ulysses(tower) -> None:
    """Route ``tower``'s attention through :func:`ulysses_attention` (once, before the
    first :func:`sp_tower_forward`; calls without a context still run plain SDPA)."""
    tower.config._attn_implementation = ATTN_IMPLEMENTATION


def _slice(plan: TowerPlan, tower, grid_cpu, n: int, rank: int):
    """``(layout, this rank's patch index, lo, hi, stand_in rows)`` of one call."""
    order = plan.order(tower, grid_cpu)
    layout = plan_slices(plan.cuts(tower, grid_cpu), n)
    lo, hi = layout.bounds[rank], layout.bounds[rank + 1]
    # HF towers cannot run on 0 rows: a rank with an empty slice runs a stand-in slice of
    # one merge unit whose rows take part in no all-to-all and whose outputs are dropped
    stand_in = 0 if hi > lo else plan.merge_unit(tower)
    if stand_in:
        lo, hi = 0, stand_in
    index = order[lo:hi] if order is not None else torch.arange(lo, hi)
    return layout, index, lo, hi, stand_in


class HostRows:
    """Host arrays (e.g. each image's ``(patches, D)`` pixels, views of a dataset) read as
    one ``(N, D)`` sequence without concatenating them: :meth:`take` copies only the rows
    a rank needs (touching only their pages) and moves them to ``device``.

    Example:
        >>> import numpy as np
        >>> rows = HostRows([np.zeros((2, 3)), np.ones((3, 3))], "cpu")
        >>> rows.take(torch.tensor([4, 0])).tolist()
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """

    def __init__(self, arrays, device, dtype=torch.float32):
        self.arrays = [np.asarray(a) for a in arrays]  # no copy for arrays; lists too
        self.device, self.dtype = torch.device(device), dtype
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (host integers) on ``device``; to a GPU from pinned memory,
        without blocking the host (the pinned allocator keeps the buffer until copied)."""
        idx = index.cpu().numpy()
        which = np.searchsorted(self.starts, idx, side="right") - 1
        pinned = self.device.type == "cuda"
        shape = (len(idx), *self.arrays[0].shape[1:])
        buf = torch.empty(shape, dtype=self.dtype, pin_memory=pinned)
        out = buf.numpy()
        for a in np.unique(which):
            sel = which == a
            out[sel] = self.arrays[a][idx[sel] - self.starts[a]]
        return buf.to(self.device, non_blocking=pinned)


def sp_tower_forward(
    tower, pixel_values: torch.Tensor | HostRows, grid_thw: torch.Tensor, plan: TowerPlan, group
) -> list[torch.Tensor]:
    """The tower's forward with this rank holding only its slice of the patch sequence
    (``tower`` prepared by :func:`enable_ulysses`; ``group``: the SP process group;
    ``pixel_values`` a tensor of the whole sequence or its :class:`HostRows`).

    Returns ``plan.outputs`` (merged embeddings first), each ``(num_tokens, D)`` in token
    order on SP rank 0 and ``(0, D)`` (still in the graph) on the other SP ranks.
    """
    if tower.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError("call enable_ulysses(tower) before sp_tower_forward.")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    grid_cpu = grid_thw.cpu()
    layout, index, lo, hi, stand_in = _slice(plan, tower, grid_cpu, n, rank)
    context = UlyssesContext(
        group=group,
        rank=rank,
        seq_lens=tuple(layout.seq_lens),
        segments=tuple(plan.full_cu_seqlens(tower, grid_cpu).diff().tolist()),  # on the host
        full_attention=frozenset(id(m) for m in plan.full_attention_modules(tower)),
        stand_in=stand_in,
    )
    kwargs = plan.local_kwargs(tower, grid_cpu, index, lo, hi)
    kwargs = {k: v.to(pixel_values.device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    if isinstance(pixel_values, HostRows):
        pixels = pixel_values.take(index)
    else:
        pixels = pixel_values[index.to(pixel_values.device)]
    outputs = plan.outputs(tower(pixels, grid_thw=grid_thw, ulysses=context, **kwargs))
    if stand_in:
        outputs = [o[:0] for o in outputs]
    units = [s // plan.merge_unit(tower) for s in layout.seq_lens]
    gathered = [GatherToLeader.apply(o, units, rank, group) for o in outputs]
    restore = plan.restore(tower, grid_cpu)
    if rank == 0 and restore is not None:
        gathered = [g[restore.to(g.device)] for g in gathered]
    return gathered
