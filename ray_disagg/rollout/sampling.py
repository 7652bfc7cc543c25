"""Seeded sampling of the next token from the LLM's logits, each rank holding a slice of
the vocabulary (tensor parallelism's vocabulary-parallel head) or all of it.

The noise is a function of ``(completion key, position, vocabulary id)`` computed with
integer hashing (splitmix64 on int64 tensors), not drawn from a generator: every rank
computes the noise of its own vocabulary slice, the draw does not depend on how the
vocabulary is split, on the device or on what was sampled before, and a resumed run
draws the same tokens. Sampling is Gumbel-max: ``argmax(scores + Gumbel noise)`` draws
from ``softmax(scores)``; the scores are Hugging Face's warpers in ``generate``'s order
(temperature, then top-k, then top-p), with their tie and minimum-token rules. Each rank
takes the best of its slice and the ranks' bests are gathered (the lowest vocabulary id
wins a tie, as ``torch.argmax`` on the whole row). Top-k gathers each rank's ``k`` best
scores; top-p gathers the whole row (its cumulative sum needs every score).

Example:
    >>> keys = completion_keys(seed=0, step=3, prompt_ids=[7], num_generations=2)
    >>> logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    >>> next_tokens(logits, keys, positions=torch.tensor([0, 0]), greedy=True).tolist()
    [1, 1]
"""

from __future__ import annotations

import hashlib
import math
import numbers

import torch
import torch.distributed as dist

__all__ = ["completion_keys", "gumbel_noise", "next_tokens", "suppress_mask"]


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (products wrap modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _signed(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_VOCAB = _signed(0x632BE59BD9B4E019)


def _prompt_key(prompt_id) -> int:
    """A stable 64-bit key of a prompt id (an int or a str, numpy's too; not Python's
    salted hash)."""
    if isinstance(prompt_id, numbers.Integral) and not isinstance(prompt_id, bool):
        prompt_id = int(prompt_id)
    elif isinstance(prompt_id, str):
        prompt_id = str(prompt_id)
    digest = hashlib.blake2b(repr(prompt_id).encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def completion_keys(seed: int, step: int, prompt_ids, num_generations: int) -> torch.Tensor:
    """``(len(prompt_ids) * num_generations,)`` int64: the key of each completion, a
    function of ``(seed, step, prompt id, completion index)``, prompt by prompt."""
    rows = [
        [_signed(seed), _signed(step), _prompt_key(p), g]
        for p in prompt_ids
        for g in range(num_generations)
    ]
    key = torch.zeros(len(rows), dtype=torch.int64)
    for column in torch.tensor(rows, dtype=torch.int64).unbind(1):
        key = _mix(key ^ column)
    return key


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_start: int,
                 vocab_end: int) -> torch.Tensor:  # fmt: skip
    """``(n, vocab_end - vocab_start)`` float32 standard Gumbel noise of vocabulary ids
    ``[vocab_start, vocab_end)`` for ``n`` completions (``keys``, int64) at their
    ``positions`` (int64; the completion token's index), on ``keys``' device."""
    row = _mix(keys.to(torch.int64) ^ _mix(positions.to(keys.device, torch.int64)))
    vocab = torch.arange(vocab_start, vocab_end, dtype=torch.int64, device=keys.device)
    h = _mix(row.unsqueeze(1) ^ (vocab * _VOCAB).unsqueeze(0))
    u = (_shr(h, 12).to(torch.float64) + 0.5) * 2.0**-52  # 52 bits: exactly in (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along ``dim`` in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def _top_k(scores: torch.Tensor, k: int, group) -> torch.Tensor:
    """Scores below the row's ``k``-th best (over the whole vocabulary) set to -inf."""
    local = scores.topk(min(k, scores.shape[-1]), dim=-1).values
    best = local if group is None else _gather(local, group, -1)
    kth = best.topk(min(k, best.shape[-1]), dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, p: float, vocab_start: int, group, vocab_size=None):
    """Hugging Face's ``TopPLogitsWarper`` on the whole row (keeps at least one token);
    ``vocab_size``: the real row's width when the last slice is padded (the sort sees the
    row HF's does, ties included)."""
    full = scores if group is None else _gather(scores, group, -1)
    full = full if vocab_size is None else full[..., :vocab_size]
    ordered, order = full.sort(dim=-1)
    remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - p
    remove[..., -1:] = False
    remove = remove.scatter(-1, order, remove)
    mine = remove[:, vocab_start : vocab_start + scores.shape[-1]]
    pad = scores.shape[-1] - mine.shape[-1]  # the padding: removed
    mine = torch.nn.functional.pad(mine, (0, pad), value=True) if pad else mine
    return scores.masked_fill(mine, float("-inf"))


def suppress_mask(ids, vocab_start: int, size: int, device) -> torch.Tensor | None:
    """``(size,)`` bool: which of the vocabulary ids ``[vocab_start, vocab_start + size)``
    are among ``ids`` (``None`` when none is), built once per decode (no host copy per
    token)."""
    local = [i - vocab_start for i in ids if 0 <= i - vocab_start < size]
    if not local:
        return None
    mask = torch.zeros(size, dtype=torch.bool)
    mask[local] = True
    return mask.to(device)


def next_tokens(
    logits: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    group=None,
    suppress: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``(n,)`` int64 vocabulary ids drawn from ``logits`` ``(n, V_r)`` (this rank's slice
    ``[vocab_start, vocab_start + V_r)``; ``group``: the tensor-parallel group holding the
    other slices, the same ``V_r`` each (a last slice shorter than the others padded with
    ``-inf`` logits: ``ray_disagg.rollout.decode``), or ``None``), for
    completions ``keys`` at
    ``positions``: ``greedy`` takes the best logit; else the scores are ``logits /
    temperature``, top-k (0: off) and top-p (1.0: off) filtered, plus the noise. The
    same on every rank of ``group``. Where ``suppress`` (``(V_r,)`` bool, this rank's
    slice: :func:`suppress_mask`) is set, nothing is drawn (HF's ``suppress_tokens``:
    e.g. the media placeholders, whose rows only encoders fill). ``vocab_size``: the
    vocabulary's real size when the slices are padded."""
    vocab_start = vocab_start if group is not None else 0
    scores = logits.float()
    if suppress is not None:
        scores = scores.masked_fill(suppress, -math.inf)
    if not greedy:
        scores = scores / temperature
        if top_k > 0:
            scores = _top_k(scores, top_k, group)
        if top_p < 1.0:
            scores = _top_p(scores, top_p, vocab_start, group, vocab_size)
        end = vocab_start + scores.shape[-1]
        scores = scores + gumbel_noise(keys, positions, vocab_start, end).to(scores.device)
    value, index = scores.max(dim=-1)
    if group is None:
        return index + vocab_start
    values = _gather(value.unsqueeze(0), group, 0)  # (ranks, n)
    indices = _gather((index + vocab_start).unsqueeze(0), group, 0)
    return indices.gather(0, values.argmax(dim=0, keepdim=True)).squeeze(0)
