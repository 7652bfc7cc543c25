"""The decode loop of rollouts on the training groups: completions of a batch of prompts
from the LLM part as it is placed for training (its tensor-parallel plan and, with FSDP2,
its sharded units), with a KV cache, without gradients and without a second copy of the
model.

The prompts are left-padded (each row's last token at the end), prefilled once with the
crossings the encoders sent (each prompt's media encoded once for all its completions),
and every step samples one token per row on this rank's vocabulary slice
(:func:`ray_disagg.rollout.sampling.next_tokens`). A row ends at a stop token (kept in
the completion) or at ``max_new_tokens``; the loop ends when every row has ended on every
rank of ``sync_group`` (ranks whose forwards run collectives together, such as FSDP2's
all-gathers, decode in lockstep as ``generate(synced_gpus=True)`` does).

Example:
    >>> left_padded({"input_ids": torch.tensor([[5, 6, 0], [7, 8, 9]])}, [2, 3])["input_ids"]
    tensor([[0, 5, 6],
            [7, 8, 9]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_disagg.parallel.tensor_parallel import vocab_rows
from ray_disagg.rollout.sampling import next_tokens, suppress_mask

__all__ = ["Completions", "DecodeSettings", "generate", "left_padded"]


@dataclass(frozen=True, kw_only=True)
class DecodeSettings:
    """How completions are drawn."""

    max_new_tokens: int
    """Most tokens per completion."""
    stop_ids: tuple[int, ...] = ()
    """Tokens that end a completion (kept in it)."""
    greedy: bool = False
    """Take the most likely token (validation prompts); else sample."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    pad_id: int = 0
    """The token fed to rows that have ended."""
    suppress_ids: tuple[int, ...] = ()
    """Tokens never drawn (the family's media placeholders)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"{self}: max_new_tokens >= 1, temperature > 0 and 0 < top_p <= 1 are needed."
            )
        if self.top_k < 0:
            raise ValueError(f"{self}: top_k >= 0 (0: off) is needed.")


@dataclass(frozen=True)
class Completions:
    """A batch's completions."""

    tokens: list[list[int]]
    """Each row's completion, its stop token included when it stopped."""
    truncated: list[bool]
    """Each row reached ``max_new_tokens`` without a stop token."""


def left_padded(batch: dict, lengths: list[int]) -> dict:
    """``batch`` (right-padded rows of ``lengths`` tokens) with every ``(rows, width)``
    tensor's rows moved right, so that each row's last token is at the end (the padding
    first, masked by ``attention_mask``)."""
    rows = len(lengths)
    width = batch["input_ids"].shape[1]
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == (rows, width):
            value = torch.stack([row.roll(width - n) for row, n in zip(value, lengths)])
        out[key] = value
    return out


def generate(
    adapter,
    module,
    lm_head,
    batch: dict,
    received: dict,
    keys: torch.Tensor,
    settings: DecodeSettings,
    *,
    tp_group=None,
    vocab_start: int = 0,
    sync_group=None,
) -> Completions:
    """Completions of the left-padded prompts ``batch`` (one row per completion, each
    with its crossings in ``received`` and its sampling key in ``keys``) from the LLM
    part ``module`` and its ``lm_head`` (this rank's vocabulary slice from
    ``vocab_start`` under ``tp_group``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=module.config)
    with torch.no_grad():
        hidden, state = adapter.prefill(module, batch, received, cache)
        device, rows = hidden.device, len(keys)
        keys = keys.to(device)
        stop = torch.tensor(settings.stop_ids or [-1]).to(device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        tokens, lengths = [], torch.zeros(rows, dtype=torch.long, device=device)
        width, vocab = _shard_width(lm_head, tp_group), lm_head.weight.shape[0]
        for step in range(settings.max_new_tokens):
            logits = _pad_vocab(lm_head(hidden), width)
            if step == 0:  # this rank's slice of the vocabulary: its suppressed ids once
                start = vocab_start if tp_group is not None else 0
                mask = suppress_mask(settings.suppress_ids, start, logits.shape[-1], device)
            token = _draw(logits, keys, step, settings, tp_group, vocab_start, mask, vocab)
            token = torch.where(ended, torch.full_like(token, settings.pad_id), token)
            lengths += (~ended).long()
            ended = ended | torch.isin(token, stop)
            tokens.append(token)
            if _all_ended(ended, sync_group) or step + 1 == settings.max_new_tokens:
                break
            hidden, state = adapter.decode_step(module, token, step, state, cache)
    drawn = torch.stack(tokens, 1).tolist()
    ended_by_stop = ended.tolist()
    return Completions(
        tokens=[row[:n] for row, n in zip(drawn, lengths.tolist())],
        truncated=[not e for e in ended_by_stop],
    )


def _shard_width(lm_head, tp_group) -> int | None:
    """The widest rank's vocabulary rows under ``tp_group`` (``ceil(V / tp)``: the sampling
    gathers equal widths), else ``None``."""
    if tp_group is None:
        return None
    return vocab_rows(lm_head.weight.shape[0], dist.get_world_size(tp_group))


def _pad_vocab(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """The last rank's shorter vocabulary slice padded to ``width`` with ``-inf`` logits
    (never drawn: their scores stay ``-inf`` through every filter and the noise)."""
    if width is None or logits.shape[-1] == width:
        return logits
    return torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=-math.inf)


def _draw(logits, keys, step, settings: DecodeSettings, tp_group, vocab_start, suppress, vocab):
    positions = torch.full_like(keys, step)
    return next_tokens(
        logits, keys, positions, vocab_start=vocab_start, temperature=settings.temperature,
        top_k=settings.top_k, top_p=settings.top_p, greedy=settings.greedy, group=tp_group,
        suppress=suppress, vocab_size=vocab,
    )  # fmt: skip


def _all_ended(ended: torch.Tensor, sync_group) -> bool:
    """Whether every row has ended here and on every rank of ``sync_group`` (a host
    read per token, as ``generate`` makes)."""
    left = (~ended).sum().reshape(1)
    if sync_group is not None:
        dist.all_reduce(left, group=sync_group)
    return int(left[0]) == 0
