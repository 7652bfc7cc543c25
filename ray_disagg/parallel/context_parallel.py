"""Ulysses context parallelism for the LLM, through its unmodified HF forward.

The ``cp`` ranks of an LLM replica all run the model's own embedding, merge of the
encoders' crossings and multimodal rope positions over the whole batch (cheap next to the
decoder), then each keeps a contiguous slice of the sequence (:func:`slice_bounds`) for the
decoder layers: a forward pre-hook on the decoder stack (:func:`enable_context_parallel`)
cuts ``inputs_embeds`` and ``position_ids`` to the slice (a family's other inputs along
the sequence: its ``prepare_context`` hook) and hands the layers no mask.
Every attention call swaps sequence and heads with an all-to-all
(:class:`~ray_disagg.parallel.ulysses.SeqToHeads`), attends over the whole sequence
(causal per row; with packed rows, causal within each sample, the samples found where the
text positions restart at 0; the layer's sliding window and a family's bidirectional
blocks honoured, the mask built per query chunk: :mod:`~ray_disagg.parallel.context_mask`)
and swaps back. The decoder's output is the slice's hidden
states; the loss takes the slice's next-token targets (:func:`local_targets`), so the
label shift crosses slice boundaries, and the replica's loss is the sum over its ranks.

The slice of one call is a :class:`ContextSlice`, passed as the ``context`` keyword of
the model's forward; HF hands it to the decoder stack, every layer and attention call, and
activation checkpointing recomputes a layer with the keywords of its own call.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from ray_disagg.models.base import IGNORE_INDEX
from ray_disagg.parallel.context_mask import SequenceMask, chunked_attention
from ray_disagg.parallel.ulysses import HeadsToSeq, SeqToHeads

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ContextSlice",
    "AllReduceOverContext",
    "context_attention",
    "enable_context_parallel",
    "local_targets",
    "slice_bounds",
]

ATTN_IMPLEMENTATION = "ray_disagg_context"
MASK_KINDS = ("full_attention", "sliding_attention", "linear_attention")
"""The layer kinds of HF's mask mapping (``config.layer_types``)."""


def slice_bounds(seq_len: int, size: int) -> list[tuple[int, int]]:
    """Each rank's ``[lo, hi)`` of a sequence of ``seq_len`` positions: contiguous, as
    even as possible (the first ranks one longer). ``ValueError`` when a rank would get
    nothing."""
    if seq_len < size:
        raise ValueError(
            f"a sequence of {seq_len} tokens is shorter than the context-parallel degree "
            f"{size}; every rank needs at least one token"
        )
    base, extra = divmod(seq_len, size)
    lens = [base + (r < extra) for r in range(size)]
    starts = [sum(lens[:r]) for r in range(size)]
    return [(s, s + n) for s, n in zip(starts, lens)]


def local_targets(labels: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Next-token targets of positions ``[lo, hi)`` (the last position has none)."""
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], 1)
    return shifted[:, lo:hi]


class AllReduceOverContext(torch.autograd.Function):
    """Per-sequence values summed over the ``cp`` ranks of a replica, with gradients.

    Forward: ``x`` (any shape; this rank's partial sums, e.g. a slice's log-probabilities
    of each sequence) all-reduced (SUM) over ``group``: every rank gets the replica's
    totals. Backward: the incoming gradients all-reduced (SUM) too, since every rank's
    partial enters every rank's total and each rank's loss may use the totals with its
    own coefficient (a term counted once is multiplied by 1 on one rank and 0 on the
    others). Every rank must run the backward (the same graph on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class ContextSlice:
    """One forward call's split of the sequence over the ``cp`` group."""

    group: dist.ProcessGroup
    """The context-parallel process group of this replica."""
    rank: int
    """This rank in ``group``."""
    bounds: tuple[tuple[int, int], ...]
    """Each rank's ``[lo, hi)`` (:func:`slice_bounds`)."""
    packed: bool = False
    """The rows are packed (several samples each; their text positions restart at 0)."""
    blocks: torch.Tensor | None = None
    """``(B, S)`` ids of bidirectional blocks (``-1`` outside), set by the adapter of a
    family whose tokens attend forward within a block (Gemma 3's images)."""
    lookahead: int = 0
    """The most positions a block reaches forward (its length - 1)."""
    segments: torch.Tensor | None = None
    """Packed rows: ``(B, S)`` sample ids (set by the pre-hook); ``None``: one sample per
    row."""

    def attention_mask(self, window: int | None) -> SequenceMask:
        """The whole rows' mask of a layer with sliding ``window`` (``None``: full)."""
        return SequenceMask(self.segments, self.blocks, self.lookahead, window)

    @property
    def seq_lens(self) -> list[int]:
        return [hi - lo for lo, hi in self.bounds]


def _segments(text_positions: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` sample ids of packed rows (a sample starts at text position 0)."""
    return (text_positions == 0).cumsum(-1)


def _slice_inputs(_module, args, kwargs):
    """Pre-hook of the decoder stack: keep this rank's slice of the sequence."""
    cp: ContextSlice | None = kwargs.get("context")
    if cp is None:
        return None
    lo, hi = cp.bounds[cp.rank]
    embeds, positions = kwargs["inputs_embeds"], kwargs.get("position_ids")
    if positions is None:  # 1-D rope over padded rows: 0..S-1
        positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[:2])
    segments = None
    if cp.packed:  # the text positions: mrope's first row, or the 1-D rope's
        segments = _segments(positions[0] if positions.ndim == 3 else positions)
    kwargs["inputs_embeds"] = embeds[:, lo:hi]
    kwargs["position_ids"] = positions[..., lo:hi]
    kwargs["attention_mask"] = dict.fromkeys(MASK_KINDS)  # no layer gets a mask
    kwargs["context"] = dataclasses.replace(cp, segments=segments)
    return args, kwargs


def _to_heads(t: torch.Tensor, cp: ContextSlice) -> torch.Tensor:
    """``(B, H, s, d)`` -> ``(B, H / n, S, d)`` over the group."""
    b, h, s, d = t.shape
    x = t.permute(2, 1, 0, 3).reshape(s, h, b * d).contiguous()
    y = SeqToHeads.apply(x, cp.seq_lens, cp.rank, cp.group)
    return y.view(y.shape[0], y.shape[1], b, d).permute(2, 1, 0, 3)


def context_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, context=None, **kwargs
):
    """``AttentionInterface`` function: ``query/key/value`` ``(B, H, s, d)`` (this rank's
    positions) -> ``(B, s, H, d)``. With a :class:`ContextSlice` (``context``): attends over
    the whole sequence with this rank's share of the heads (KV heads that do not split over
    the ``n`` ranks are each repeated ``n / gcd(KV, n)`` times first, which divides the
    query heads per KV head since ``n`` divides the query heads); without one, plain
    SDPA."""
    cp: ContextSlice | None = context
    if cp is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    b, h, s, d = query.shape
    n, kv = len(cp.bounds), key.shape[1]
    if kv % n:  # KV heads that do not split: repeat each the fewest times that do
        key, value = (repeat_kv(t, n // math.gcd(kv, n)) for t in (key, value))
    q, k, v = (_to_heads(t, cp) for t in (query, key, value))
    heads = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True)
    mask = cp.attention_mask(kwargs.get("sliding_window"))
    out = chunked_attention(heads, q, k, v, mask, scaling, dropout)  # (B, S, H / n, d)
    x = out.permute(1, 2, 0, 3).reshape(out.shape[1], out.shape[2], b * d).contiguous()
    y = HeadsToSeq.apply(x, cp.seq_lens, cp.rank, cp.group)  # (s, H, B * d)
    return y.view(s, h, b, d).permute(2, 0, 1, 3), None


AttentionInterface.register(ATTN_IMPLEMENTATION, context_attention)


def enable_context_parallel(decoder: torch.nn.Module) -> None:
    """Route ``decoder``'s attention through :func:`context_attention` and slice its
    inputs when a call carries a ``context`` (once, before the first call; calls without
    one run as before)."""
    decoder.config._attn_implementation = ATTN_IMPLEMENTATION
    decoder.register_forward_pre_hook(_slice_inputs, with_kwargs=True)
