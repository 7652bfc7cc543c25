"""The LLM's loss: the summed next-token cross-entropy over the label positions (vocab-
parallel under TP, in chunks with ``loss_chunk_tokens``), divided by the caller; and the
per-token log-probabilities that objectives take, through the same path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ray_disagg.models.base import IGNORE_INDEX

__all__ = ["lm_loss", "lm_loss_by_sequence", "loss_index", "sequence_logps", "token_logps"]


def loss_index(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Flat indices into ``hidden[:, :-1]`` of the positions whose next token is a label
    (computed on the host with the batch, so the loss needs no device sync); ``shifted``:
    ``labels`` are already each position's next-token targets, indices into ``hidden``."""
    targets = labels if shifted else labels[:, 1:]
    return (targets != IGNORE_INDEX).flatten().nonzero().flatten()


def _token_loss_sum(hidden, targets, lm_head, tp_group, vocab_start) -> torch.Tensor:
    """Summed cross-entropy of ``hidden`` ``(n, d)`` against ``targets`` ``(n,)``."""
    logits = lm_head(hidden).float()
    if tp_group is not None:
        from ray_disagg.parallel.tensor_parallel import VocabParallelCrossEntropy

        per_token = VocabParallelCrossEntropy.apply(
            logits, targets, vocab_start, IGNORE_INDEX, tp_group
        )
        return per_token.sum()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _token_ce(hidden, targets, lm_head, tp_group, vocab_start, temperature=1.0) -> torch.Tensor:
    """Per-position cross-entropy ``(n,)`` of ``hidden`` ``(n, d)`` against ``targets``
    (the logits divided by ``temperature``)."""
    logits = lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if tp_group is not None:
        from ray_disagg.parallel.tensor_parallel import VocabParallelCrossEntropy

        return VocabParallelCrossEntropy.apply(logits, targets, vocab_start, IGNORE_INDEX, tp_group)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _label_positions(hidden, labels, index, shifted):
    """``(hidden rows, targets)`` at the label positions ``index``."""
    if index is None:
        index = loss_index(labels.cpu(), shifted).to(hidden.device)
    if not shifted:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    return hidden.flatten(0, 1).index_select(0, index), labels.flatten().index_select(0, index)


def _per_chunk(fn, flat, targets, chunk_tokens, min_chunks, *args) -> list[torch.Tensor]:
    """``fn(hidden, targets, *args)`` of every chunk of ``chunk_tokens`` label positions
    (at least ``min_chunks``, empty ones last), each under activation checkpointing; one
    plain call without ``chunk_tokens`` or when one chunk holds them all."""
    positions = len(targets)
    chunks = 1 if chunk_tokens is None else max(-(-positions // chunk_tokens), min_chunks)
    if chunks == 1:
        return [fn(flat, targets, *args)]
    from torch.utils.checkpoint import checkpoint

    return [
        checkpoint(
            fn, flat[lo : lo + chunk_tokens], targets[lo : lo + chunk_tokens], *args,
            use_reentrant=False,
        )
        for lo in range(0, chunks * chunk_tokens, chunk_tokens)
    ]  # fmt: skip


def token_logps(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    tp_group=None,
    vocab_start: int = 0,
    *,
    index: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    shifted: bool = False,
    min_chunks: int = 1,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``(len(index),)`` float32: the log-probability of each label token
    (``log p(label | prefix)``, the logits divided by ``temperature``), through the path
    of :func:`lm_loss` (label positions only, vocab-parallel under ``tp_group``,
    ``chunk_tokens`` positions at a time under activation checkpointing, a context
    slice's targets with ``shifted``)."""
    flat, targets = _label_positions(hidden, labels, index, shifted)
    args = (lm_head, tp_group, vocab_start, temperature)
    return -torch.cat(_per_chunk(_token_ce, flat, targets, chunk_tokens, min_chunks, *args)).float()


def sequence_logps(
    hidden, lm_head, labels, sequence, num_sequences, tp_group=None, vocab_start=0, **kwargs
) -> torch.Tensor:
    """``(num_sequences,)`` float32: each sequence's summed :func:`token_logps` (same
    keyword arguments); ``sequence`` ``(len(index),)``: the sequence of each label
    position (several per row when rows are packed). With a context slice these are the
    slice's partial sums."""
    logps = token_logps(hidden, lm_head, labels, tp_group, vocab_start, **kwargs)
    return logps.new_zeros(num_sequences).index_add(0, sequence.to(logps.device), logps)


def lm_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    num_label_tokens: float,
    tp_group=None,
    vocab_start: int = 0,
    *,
    index: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    shifted: bool = False,
    min_chunks: int = 1,
) -> torch.Tensor:
    """``sum(token CE after the causal shift) / num_label_tokens``; with ``tp_group`` the
    logits are vocab-sharded and the cross-entropy is vocab-parallel.

    Logits are computed only at the positions whose next token is a label (``index``:
    :func:`loss_index` of ``labels``, computed here when not given). With
    ``chunk_tokens`` they are computed ``chunk_tokens`` positions at a time under
    activation checkpointing, so ``[tokens x vocab]`` logits never exist at once (each
    chunk's are recomputed in backward). ``shifted``: ``labels`` are each position's
    next-token targets, same length as ``hidden`` (a context-parallel slice's).
    ``min_chunks``: run at least this many chunks (empty ones last), so that ranks whose
    ``lm_head`` is one FSDP2 unit call it equally often (its collectives must match)."""
    flat, targets = _label_positions(hidden, labels, index, shifted)
    args = (lm_head, tp_group, vocab_start)
    sums = _per_chunk(_token_loss_sum, flat, targets, chunk_tokens, min_chunks, *args)
    if len(sums) == 1:
        return sums[0] / num_label_tokens
    total = flat.new_zeros((), dtype=torch.float32)
    for part in sums:
        total = total + part
    return total / num_label_tokens


def lm_loss_by_sequence(
    hidden, lm_head, labels, num_label_tokens, sequence, num_sequences, tp_group=None,
    vocab_start=0, **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`lm_loss` (same keyword arguments) and, detached, each sequence's summed
    cross-entropy ``(num_sequences,)`` (``sequence``: the sequence of each label
    position, as :func:`sequence_logps` takes it): the loss of a mixture's sources."""
    logps = sequence_logps(
        hidden, lm_head, labels, sequence, num_sequences, tp_group, vocab_start, **kwargs
    )
    return -logps.sum() / num_label_tokens, -logps.detach()
