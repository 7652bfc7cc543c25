"""Training samples and the global-batch plan (which replica of which group gets which
samples, and the M:N routes between groups).

A sample is a dict (a row of a list, a ``datasets.Dataset``, a Ray Data row):
``input_ids`` (placeholders already expanded, one token per encoder output row),
optional ``labels`` (``-100`` where no loss is taken), optional ``id`` (named in errors),
and the family's modality fields (Qwen: ``pixel_values`` + ``image_grid_thw``,
``pixel_values_videos`` + ``video_grid_thw``; Omni adds ``input_features`` +
``feature_attention_mask``). Each family's adapter validates them
(``ray_disagg.models``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from ray_disagg.models.base import SampleError, count_label_tokens
from ray_disagg.pipeline.neighbours import band_split, ring, spread

__all__ = [
    "SampleError",
    "BatchPlan",
    "CoveringPlan",
    "count_label_tokens",
    "balanced_split",
    "sample_order",
]


def balanced_split(
    positions: list[int], costs: list[float], n: int, equal_counts: bool = True
) -> list[list[int]]:
    """``positions`` into ``n`` lists by greedy longest-processing-time: largest cost
    first, to the least loaded list (fewest samples, then lowest index, on ties); with
    ``equal_counts`` only lists that still have room (``len(positions) / n`` each). Each
    list comes out in position order; every list gets a sample when there are ``n``.
    Deterministic.

    Example:
        >>> balanced_split([0, 1, 2, 3], [9.0, 1.0, 1.0, 9.0], 2)
        [[0, 1], [2, 3]]
        >>> balanced_split([0, 1, 2, 3], [9.0, 1.0, 1.0, 1.0], 2, equal_counts=False)
        [[0], [1, 2, 3]]
    """
    per = len(positions) // n if equal_counts else len(positions)
    loads, out = [0.0] * n, [[] for _ in range(n)]
    for c, p in sorted(zip(costs, positions), key=lambda cp: (-cp[0], cp[1])):
        r = min(
            (r for r in range(n) if len(out[r]) < per), key=lambda r: (loads[r], len(out[r]), r)
        )
        loads[r] += c
        out[r].append(p)
    return [sorted(o) for o in out]


@functools.lru_cache(maxsize=4)
def sample_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The epoch's sample permutation (cached: every step of the epoch slices it)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=g).tolist())


@dataclass(frozen=True)
class BatchPlan:
    """Which samples form each global batch and which replica gets which of them.

    Step ``s`` of epoch ``e`` takes positions ``[s*B, (s+1)*B)`` of a permutation of the
    dataset seeded by ``(seed, e)``; the last incomplete batch of an epoch is dropped.
    Replica ``d`` of a group with data-parallel size ``n`` gets the ``d``-th contiguous
    ``B / n`` slice; two groups exchange the overlap of their replicas' slices (M:N).

    Example:
        >>> plan = BatchPlan(num_samples=8, global_batch_size=4, dp_sizes={"vision": 2, "text": 1})
        >>> plan.routes("vision", 1, "text")
        [(0, 2, 4)]
    """

    num_samples: int
    global_batch_size: int
    dp_sizes: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    shuffle: bool = False
    micro_batches: int = 1
    reader: str | None = None
    """The group that reads samples (the LLM group); the others follow its microbatches."""
    costs: dict[str, np.ndarray] | None = None
    """Per dataset index, each group's estimated cost (``None``: contiguous slices)."""
    min_tokens: int = 1
    """Tokens each LLM sequence needs (the LLM group's context-parallel degree); a
    streamed record with fewer is skipped as broken (map-style samples are checked on
    the driver)."""
    streamed_costs: bool = False
    """Costs arrive with each step's samples (a balanced stream): the reader's replicas
    keep contiguous shares, the other groups are balanced by the step's costs
    (``assign(step, step_costs)``), and every reader replica sends each of its
    neighbours in the other groups its inputs (possibly none)."""
    repeats: int = 1
    """Consecutive steps on each global batch (an objective's ``num_iterations``): step
    ``s`` takes the samples of batch ``s // repeats``."""

    def __post_init__(self) -> None:
        k = self.micro_batches
        for name, dp in self.dp_sizes.items():
            if self.global_batch_size % (dp * k):
                unit = f"{dp} x micro_batches={k}" if k > 1 else f"{dp}"
                raise ValueError(
                    f"global_batch_size={self.global_batch_size} is not divisible by the {name} "
                    f"group's data-parallel size {unit}; use a multiple of {dp * k}."
                )
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"The dataset has {self.num_samples} samples, fewer than "
                f"global_batch_size={self.global_batch_size}; every step needs a full batch."
            )

    @property
    def reader_group(self) -> str:
        """The reading group (``reader``, or the first group)."""
        return self.reader or next(iter(self.dp_sizes))

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def epoch_of(self, step: int) -> int:
        """The epoch (from 0) that ``step`` belongs to."""
        return step // self.repeats // self.steps_per_epoch

    def global_indices(self, step: int) -> list[int]:
        epoch, pos = divmod(step // self.repeats, self.steps_per_epoch)
        order = sample_order(self.num_samples, self.seed, epoch) if self.shuffle else None
        b = self.global_batch_size
        if order is None:
            return list(range(pos * b, (pos + 1) * b))
        return list(order[pos * b : (pos + 1) * b])

    def span(self, group: str, rank: int) -> tuple[int, int]:
        """Batch positions ``[lo, hi)`` of replica ``rank`` of ``group``."""
        per = self.global_batch_size // self.dp_sizes[group]
        return rank * per, (rank + 1) * per

    def assign(self, step: int, step_costs=None) -> list[dict[str, list[list[int]]]]:
        """Per microbatch, per group, per replica: the batch positions it processes (in
        position order). The reader group's replicas get contiguous slices, each cut into
        ``micro_batches`` consecutive pieces, or, balanced, equal-count bins per replica
        and microbatch that even out the LLM's and every encoder's cost at once
        (:func:`~ray_disagg.pipeline.neighbours.spread`). Microbatch ``j`` is the union of
        the pieces ``j``, which every other group splits over its replicas: contiguously,
        or balanced by its cost inside each LLM replica's neighbourhood
        (:func:`~ray_disagg.pipeline.neighbours.band_split`; counts free: one large image
        may be a replica's only sample). ``step_costs``: per group, the cost of each batch
        position (a balanced stream's step). With one microbatch and no costs this is
        :meth:`span` for every group."""
        reader = self.reader_group
        cost = self._position_costs(step, step_costs)
        loads = {g: [0.0] * n for g, n in self.dp_sizes.items()}  # over the step
        spread_bins = cost is not None and reader in cost and not self.streamed_costs
        out = []
        for shares in self._reader_bins(cost):
            mb = {reader: shares}
            for group, n in self.dp_sizes.items():
                if group == reader:
                    continue
                if spread_bins or (cost is not None and group in cost):
                    # spread bins are not contiguous: a group without costs splits by none
                    costs = cost.get(group) or [0.0] * self.global_batch_size
                    mb[group] = band_split(shares, costs, n, loads[group])
                else:
                    union = sorted(p for share in shares for p in share)
                    per = len(union) // n
                    mb[group] = [union[r * per : (r + 1) * per] for r in range(n)]
            out.append(mb)
        return out

    def _reader_bins(self, cost) -> list[list[list[int]]]:
        """Per microbatch, per reader replica: its batch positions."""
        b, k, reader = self.global_batch_size, self.micro_batches, self.reader_group
        n = self.dp_sizes[reader]
        if cost is None or reader not in cost or self.streamed_costs:
            per = b // n
            shares = [list(range(r * per, (r + 1) * per)) for r in range(n)]
            per //= k
            return [[share[j * per : (j + 1) * per] for share in shares] for j in range(k)]
        kinds = [cost[reader]] + [cost[g] for g in self.dp_sizes if g != reader and g in cost]
        bins = spread(list(range(b)), kinds, n * k)
        return [bins[j * n : (j + 1) * n] for j in range(k)]

    def _position_costs(self, step: int, step_costs) -> dict[str, list[float]] | None:
        """Per group, the cost of each batch position of ``step`` (``None``: no costs)."""
        if step_costs is not None:
            return {g: np.asarray(v, dtype=np.float64).tolist() for g, v in step_costs.items()}
        if self.costs is None:
            return None
        idx = np.asarray(self.global_indices(step), dtype=np.int64)
        return {g: np.asarray(v, dtype=np.float64)[idx].tolist() for g, v in self.costs.items()}

    def neighbours(self, group: str, rank: int, other: str) -> tuple[int, ...]:
        """The replicas of ``other`` that replica ``rank`` of ``group`` may ever exchange
        with (:func:`~ray_disagg.pipeline.neighbours.ring`, cached; every replica
        between two groups that are not the reader)."""
        reader = self.reader_group
        if reader == group:
            return ring(self.dp_sizes[other], self.dp_sizes[group])[0][rank]
        if reader == other:
            return ring(self.dp_sizes[group], self.dp_sizes[other])[1][rank]
        return tuple(range(self.dp_sizes[other]))

    def peers(self, group: str, rank: int, other: str, step: int, mbs=None) -> list[int]:
        """Replicas of ``other`` that share samples with replica ``rank`` of ``group`` in
        some microbatch of ``step`` (they exchange messages that step), ascending; ``mbs``:
        ``assign(step)`` when the caller has it already. With ``streamed_costs``, between
        the reader and another group: every neighbour (the inputs go to all)."""
        near = self.neighbours(group, rank, other)
        if self.streamed_costs and self.reader_group in (group, other):
            return list(near)
        mbs = self.assign(step) if mbs is None else mbs
        mine = [set(mb[group][rank]) for mb in mbs]
        return [r for r in near if any(m & set(mb[other][r]) for m, mb in zip(mine, mbs))]

    def exchange_pairs(self, group: str, other: str) -> set[tuple[int, int]]:
        """``(rank, other_rank)`` replica pairs that may ever exchange samples: the
        overlaps of the contiguous slices, or (balanced) every pair of neighbours."""
        if self.costs is not None or self.streamed_costs:
            return self.neighbour_pairs(group, other)
        return {
            (a, b) for a in range(self.dp_sizes[group]) for b in self.peers(group, a, other, step=0)
        }

    def neighbour_pairs(self, group: str, other: str) -> set[tuple[int, int]]:
        """``(rank, other_rank)`` for every pair of neighbours."""
        n = self.dp_sizes[group]
        return {(a, b) for a in range(n) for b in self.neighbours(group, a, other)}

    def routes(self, group: str, rank: int, other: str) -> list[tuple[int, int, int]]:
        """``(other_rank, lo, hi)``: the positions ``[lo, hi)`` that replica ``rank`` of
        ``group`` exchanges with replica ``other_rank`` of ``other``, in batch order."""
        mine = self.span(group, rank)
        out = []
        for r in range(self.dp_sizes[other]):
            lo, hi = self.span(other, r)
            lo, hi = max(lo, mine[0]), min(hi, mine[1])
            if lo < hi:
                out.append((r, lo, hi))
        return out


@dataclass(frozen=True)
class CoveringPlan(BatchPlan):
    """One pass over every sample, in dataset order (e.g. the reference model's
    log-probs computed before training): ``ceil(N / B)`` global batches of ``B``, the last
    one ending at the last sample (so it may repeat some of the batch before it).

    Example:
        >>> CoveringPlan(num_samples=10, global_batch_size=4).global_indices(2)
        [6, 7, 8, 9]
    """

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch_size)

    def global_indices(self, step: int) -> list[int]:
        b = self.global_batch_size
        lo = min(step * b, self.num_samples - b)
        return list(range(lo, lo + b))
