"""Attention over whole rows under a mask that is never built whole.

After the all-to-all of context parallelism every rank attends over the whole sequence
``S`` with its share of the heads. Causal rows need no mask (SDPA's ``is_causal``); rows
that hold several packed samples, bidirectional blocks (Gemma 3's image tokens) or a
sliding window do. A dense ``(B, 1, S, S)`` mask is ``B S^2`` bytes (4 GiB per row at
65k tokens), so :func:`chunked_attention` runs the queries in chunks of rows and builds
each chunk's mask from per-position ids (:class:`SequenceMask`) over only the keys the
chunk can reach: from the window's start (or 0) to the chunk's end plus the longest
reach of a bidirectional block. A chunk's mask holds at most :data:`MASK_ELEMENTS`
entries and is rebuilt in the backward rather than kept; the result equals one call with
the dense mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.utils.checkpoint import checkpoint
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

__all__ = ["MASK_ELEMENTS", "SequenceMask", "chunk_rows", "chunked_attention"]

MASK_ELEMENTS = 1 << 26
"""The most entries of one query chunk's mask (64 MiB of bools)."""


@dataclass(frozen=True)
class SequenceMask:
    """Who attends to whom in rows of ``S`` positions: causally, and

    - within the same sample when ``segments`` is given (``(B, S)`` ids; packed rows);
    - also forward within a bidirectional block when ``blocks`` is given (``(B, S)``
      ids, ``-1`` outside any block), a block reaching at most ``lookahead`` positions
      ahead;
    - only less than ``window`` positions back when ``window`` is given (a sliding
      window; it bounds the blocks too, as HF's ``AND(window, OR(causal, block))``).

    Example:
        >>> m = SequenceMask(blocks=torch.tensor([[-1, 0, 0, -1]]), lookahead=1)
        >>> m.rows(0, 4, 0, 4)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """

    segments: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    lookahead: int = 0
    window: int | None = None

    @property
    def causal(self) -> bool:
        """Whether this is the plain causal mask (no mask tensor needed)."""
        return self.segments is None and self.blocks is None and self.window is None

    def key_range(self, q_lo: int, q_hi: int, seq_len: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` that queries ``[q_lo, q_hi)`` may attend to."""
        lo = 0 if self.window is None else max(0, q_lo - self.window + 1)
        reach = self.lookahead if self.blocks is not None else 0
        return lo, min(seq_len, q_hi + reach)

    def rows(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int, device=None) -> torch.Tensor:
        """``(B or 1, 1, q_hi - q_lo, k_hi - k_lo)`` bool (True: attend), on ``device``
        (default: the ids')."""
        ids = self.segments if self.segments is not None else self.blocks
        device = device if device is not None or ids is None else ids.device
        q = torch.arange(q_lo, q_hi, device=device)[:, None]
        k = torch.arange(k_lo, k_hi, device=device)[None, :]
        allow = (k <= q)[None]
        if self.blocks is not None:
            bq, bk = self.blocks[:, q_lo:q_hi, None], self.blocks[:, None, k_lo:k_hi]
            allow = allow | ((bq == bk) & (bq >= 0))
        if self.window is not None:
            allow = allow & (k > q - self.window)[None]
        if self.segments is not None:
            allow = allow & (self.segments[:, q_lo:q_hi, None] == self.segments[:, None, k_lo:k_hi])
        return allow[:, None]


def chunk_rows(mask: SequenceMask, batch: int, seq_len: int, elements: int) -> int:
    """Query rows per chunk so that a chunk's mask ``(batch, rows, keys)`` holds at most
    ``elements`` entries, ``keys`` the most a chunk reaches (all ``seq_len``, or with a
    sliding window about ``rows + window + lookahead``)."""
    if mask.window is None:
        return max(1, elements // (batch * seq_len))
    span = mask.window + mask.lookahead  # rows * (rows + span) <= elements / batch
    rows = (math.sqrt(span * span + 4 * elements / batch) - span) / 2
    return max(1, min(seq_len, int(rows)))


def chunked_attention(
    module, query, key, value, mask: SequenceMask, scaling=None, dropout=0.0, elements=None
):
    """SDPA of ``query/key/value`` ``(B, H, S, d)`` (the key heads may be fewer:
    ``module.num_key_value_groups``) under ``mask``, in query chunks whose masks hold at
    most ``elements`` (default :data:`MASK_ELEMENTS`) entries -> ``(B, S, H, d)``.

    The key heads are repeated once for all chunks (SDPA with a mask takes no grouped
    heads). With several chunks each one is recomputed in the backward
    (``torch.utils.checkpoint``): its mask and SDPA's copy of it are never kept, so the
    masks of a layer never add up to a dense one. Each chunk's keys are a slice of the
    whole, so their gradient adds into the whole once per chunk (``flex_attention`` with
    a block mask would avoid that traffic)."""
    b, _, s, _ = query.shape
    if mask.causal:
        out, _ = sdpa_attention_forward(
            module, query, key, value, None, scaling=scaling, dropout=dropout, is_causal=True
        )
        return out
    groups = module.num_key_value_groups
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    heads = SimpleNamespace(num_key_value_groups=1, is_causal=False)
    rows = chunk_rows(mask, b, s, elements or MASK_ELEMENTS)

    def attend(q, k, v, lo: int):
        k_lo, k_hi = mask.key_range(lo, lo + q.shape[2], s)
        rows_mask = mask.rows(lo, lo + q.shape[2], k_lo, k_hi, q.device)
        out, _ = sdpa_attention_forward(
            heads, q, k[:, :, k_lo:k_hi], v[:, :, k_lo:k_hi], rows_mask,
            scaling=scaling, dropout=dropout, is_causal=False,
        )  # fmt: skip
        return out

    chunks = query.split(rows, dim=2)
    if len(chunks) == 1:
        return attend(query, key, value, 0)
    outs = [
        checkpoint(attend, q, key, value, i * rows, use_reentrant=False)
        for i, q in enumerate(chunks)
    ]
    return torch.cat(outs, 1)
