"""Ulysses sequence parallelism for the Qwen2.5-VL vision tower.

Each of the ``sp`` ranks of a data-parallel replica holds a contiguous slice of the
replica's patch sequence in *window order* (the order HF's tower uses internally). Slices
are cut on window boundaries, so windowed-attention blocks run locally with no
communication. Full-attention blocks swap sequence and heads with an all-to-all
(:class:`SeqToHeads`), attend over whole images, and swap back (:class:`HeadsToSeq`). The
merger runs on the local slice; :class:`GatherToLeader` assembles the merged tokens on sp
rank 0, which restores the original token order.

Slices may be uneven and empty (an image with fewer windows than ranks).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

__all__ = [
    "SeqToHeads",
    "HeadsToSeq",
    "GatherToLeader",
    "SliceLayout",
    "plan_slices",
    "sp_vision_forward",
]


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
    """Rank ``r`` holds window-ordered patch positions ``[bounds[r], bounds[r + 1])``."""

    bounds: tuple[int, ...]

    @property
    def seq_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def plan_slices(cu_window_seqlens: torch.Tensor, sp_size: int) -> SliceLayout:
    """Cut the window sequence into ``sp_size`` contiguous runs of whole windows, each cut
    at the window boundary closest to an equal share of the patches."""
    cuts = [int(c) for c in cu_window_seqlens.tolist()]
    total = cuts[-1]
    bounds = [0]
    for r in range(1, sp_size):
        target = total * r / sp_size
        # ties go to the later cut, so that lower ranks (and the leader) are never emptier
        best = min((c for c in cuts if c >= bounds[-1]), key=lambda c: (abs(c - target), -c))
        bounds.append(best)
    bounds.append(total)
    return SliceLayout(tuple(bounds))


def _ulysses_attention_forward(self, hidden_states, cu_seqlens, position_embeddings, **kwargs):
    """HF ``Qwen2_5_VLVisionAttention.forward`` with the Ulysses all-to-all around the
    attention; ``cu_seqlens`` index the whole (gathered) window-ordered sequence."""
    sp = self._ulysses
    s_local = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).reshape(s_local, 3, self.num_heads, self.head_dim)
    qkv = qkv.permute(1, 0, 2, 3)
    q, k, v = qkv.unbind(0)
    cos, sin = position_embeddings
    q, k = hf.apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (SeqToHeads.apply(t, sp.seq_lens, sp.rank, sp.group) for t in (q, k, v))
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outs = []
    for qi, ki, vi in zip(*(t.split(lengths, dim=0) for t in (q, k, v))):
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi))
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=self.scaling)
        outs.append(o.squeeze(0).transpose(0, 1))
    attn = torch.cat(outs, dim=0) if outs else q
    attn = HeadsToSeq.apply(attn.contiguous(), sp.seq_lens, sp.rank, sp.group)
    return self.proj(attn.reshape(s_local, self.num_heads * self.head_dim))


@dataclass
class _SPState:
    group: dist.ProcessGroup
    rank: int
    seq_lens: list[int]


def enable_ulysses(visual, group: dist.ProcessGroup) -> None:
    """Patch the full-attention blocks of an HF vision tower for Ulysses over ``group``."""
    state = _SPState(group=group, rank=dist.get_rank(group), seq_lens=[])
    visual._ulysses = state
    for i in visual.fullatt_block_indexes:
        attn = visual.blocks[i].attn
        attn._ulysses = state
        attn.forward = types.MethodType(_ulysses_attention_forward, attn)


def sp_vision_forward(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The tower's forward with this rank holding only its slice of the patch sequence.

    Returns the merged embeddings ``(num_image_tokens, D)`` in original token order on sp
    rank 0, and a ``(0, D)`` tensor (still part of the graph) on the other sp ranks.
    """
    sp: _SPState = visual._ulysses
    n = dist.get_world_size(sp.group)
    unit = visual.spatial_merge_unit
    position_ids = get_vision_position_ids(grid_thw, visual.spatial_merge_size)
    cu_seqlens, _ = get_vision_attention_seqlens(grid_thw, visual.config)
    window_index, cu_window = get_vision_window_index(
        grid_thw, visual.spatial_merge_size, visual.window_size, visual.patch_size
    )
    layout = plan_slices(cu_window, n)
    sp.seq_lens = layout.seq_lens
    lo, hi = layout.bounds[sp.rank], layout.bounds[sp.rank + 1]
    patch_order = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)
    local = patch_order[lo:hi].to(pixel_values.device)

    hidden = visual.patch_embed(pixel_values[local])
    cos, sin = visual.rotary_pos_emb(hidden, position_ids[local.cpu()].to(hidden.device))
    local_windows = torch.tensor(
        sorted({lo, hi} | {int(c) for c in cu_window.tolist() if lo <= c <= hi}),
        dtype=torch.int32,
    )
    local_windows = (local_windows - lo).to(hidden.device)
    for i, blk in enumerate(visual.blocks):
        full = i in visual.fullatt_block_indexes
        if not full and hidden.shape[0] == 0:
            continue  # no local windows; HF's windowed attention cannot take 0 tokens
        hidden = blk(
            hidden,
            cu_seqlens=cu_seqlens.to(hidden.device) if full else local_windows,
            position_embeddings=(cos, sin),
        )
    merged = visual.merger(hidden)
    units = [s // unit for s in layout.seq_lens]
    merged = GatherToLeader.apply(merged, units, sp.rank, sp.group)
    if sp.rank == 0:
        merged = merged[torch.argsort(window_index).to(merged.device)]
    return merged
