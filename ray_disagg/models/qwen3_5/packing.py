"""Packed rows through Qwen3.5's Gated DeltaNet layers. A linear-attention layer carries a
recurrent state and a causal convolution along its row; transformers' torch paths ignore
``cu_seqlens``, so in a packed row each sample would start from the state the previous
sample left. Instead each such layer (:func:`segment_linear_attention`) runs the samples
of a packed batch as their own rows: it gathers every sample's span ``(row, start,
length)`` (host integers, passed down as the keyword :data:`SEGMENTS` through HF's
``...Model.forward`` and decoder layers, which hand their ``**kwargs`` on) into
right-padded batches of at most the packed batch's positions (:func:`buckets`), runs
HF's own forward on each (no mask: right padding never reaches a
real position of a causal convolution or recurrence), and puts each sample's outputs
back at its span (zeros on the packed rows' padding). That is what the unpacked batch
computes for each sample, so a packed run equals the unpacked one. The softmax-attention
layers keep the packed row (HF's mask keeps the samples apart); they ignore the keyword.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SEGMENTS", "buckets", "segment_linear_attention"]

SEGMENTS = "linear_attention_spans"
"""Keyword of HF's forward carrying a packed batch's ``((row, start, length), ...)``."""


def segment_linear_attention(decoder: nn.Module) -> None:
    """Let every ``linear_attn`` layer of ``decoder`` run a packed batch's samples as
    their own rows (see the module docstring); a call without :data:`SEGMENTS` is HF's.
    The layer's forward at this point (HF's, or the tensor-parallel plan's) is kept and
    called."""
    for layer in decoder.layers:
        attn = getattr(layer, "linear_attn", None)
        if attn is not None:
            inner = attn.forward
            attn.forward = types.MethodType(_segmented(inner), attn)


def _segmented(inner):
    def forward(self, hidden_states, *args, **kwargs):
        segments = kwargs.pop(SEGMENTS, None)
        if segments is None:
            return inner(hidden_states, *args, **kwargs)
        kwargs["attention_mask"] = None
        outputs = [None] * len(segments)
        b, t = hidden_states.shape[:2]
        for bucket in buckets([n for _, _, n in segments], b * t):
            spans = [segments[i] for i in bucket]
            rows = inner(gather_segments(hidden_states, spans), *args, **kwargs)
            for j, (i, (_, _, n)) in enumerate(zip(bucket, spans)):
                outputs[i] = rows[j, :n]
        return scatter_segments(outputs, segments, hidden_states.shape)

    return forward


def buckets(lengths, budget: int) -> list[list[int]]:
    """Sample indices in groups whose right-padded batch (count x the longest) holds at
    most ``budget`` positions (the packed batch's), longest first, so that the layer never
    runs on more positions than the packed rows hold (one group per sample at worst).

    Example:
        >>> buckets([8000, 80, 80, 80], 8192)
        [[0], [1, 2, 3]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def gather_segments(packed: torch.Tensor, segments) -> torch.Tensor:
    """``(B, T, ...)`` packed rows -> ``(n, L, ...)``: each span ``(row, start, length)``
    as its own row, right-padded with zeros to the longest ``L``."""
    width = max(n for _, _, n in segments)
    rows = []
    for row, start, n in segments:
        span = packed[row, start : start + n]
        pad = [0, 0] * (span.dim() - 1) + [0, width - n]
        rows.append(F.pad(span, pad))
    return torch.stack(rows)


def scatter_segments(outputs, segments, shape) -> torch.Tensor:
    """Each span's outputs ``(length, ...)`` (in ``segments``' order) back into packed
    rows of ``shape`` ``(B, T, ...)``, zeros where no span lies."""
    by_row: dict[int, list[tuple[int, int, int]]] = {}
    for i, (row, start, n) in enumerate(segments):
        by_row.setdefault(row, []).append((start, n, i))
    tail, like = tuple(shape[2:]), outputs[0]
    out = []
    for row in range(shape[0]):
        pieces, end = [], 0
        for start, n, i in sorted(by_row.get(row, [])):
            if start > end:
                pieces.append(like.new_zeros((start - end, *tail)))
            pieces.append(outputs[i])
            end = start + n
        if end < shape[1]:
            pieces.append(like.new_zeros((shape[1] - end, *tail)))
        out.append(torch.cat(pieces))
    return torch.stack(out)
