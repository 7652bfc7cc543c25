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

from dataclasses import dataclass, field

import numpy as np
import torch

from ray_disagg.models.base import IGNORE_INDEX, SampleError

__all__ = ["SampleError", "BatchPlan", "count_label_tokens"]


def count_label_tokens(labels: np.ndarray) -> int:
    """Tokens that enter the loss after the causal shift."""
    return int((np.asarray(labels)[1:] != IGNORE_INDEX).sum())


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

    def __post_init__(self) -> None:
        for name, dp in self.dp_sizes.items():
            if self.global_batch_size % dp:
                raise ValueError(
                    f"global_batch_size={self.global_batch_size} is not divisible by the {name} "
                    f"group's data-parallel size {dp}; use a multiple of {dp}."
                )
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"The dataset has {self.num_samples} samples, fewer than "
                f"global_batch_size={self.global_batch_size}; every step needs a full batch."
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def global_indices(self, step: int) -> list[int]:
        epoch, pos = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        b = self.global_batch_size
        return order[pos * b : (pos + 1) * b]

    def span(self, group: str, rank: int) -> tuple[int, int]:
        """Batch positions ``[lo, hi)`` of replica ``rank`` of ``group``."""
        per = self.global_batch_size // self.dp_sizes[group]
        return rank * per, (rank + 1) * per

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
