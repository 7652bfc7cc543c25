"""Training samples, their validation, batching and the global-batch plan.

A sample is a dict (a row of a list, a ``datasets.Dataset`` or any map-style dataset):

- ``input_ids``: token ids, with each image's placeholder already expanded to one
  ``image_token_id`` per merged image token (what the Qwen2.5-VL processor produces);
- ``labels`` (optional): targets, ``-100`` where no loss is taken; default: ``input_ids``
  with image tokens ignored;
- ``pixel_values`` (optional): ``(num_patches, C * T * P * P)`` patches of all the sample's
  images, as the Qwen2.5-VL image processor returns them;
- ``image_grid_thw`` (optional): ``(num_images, 3)`` patch grid of each image;
- ``id`` (optional): a name used in error messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_disagg.model import IGNORE_INDEX

__all__ = ["SampleError", "BatchPlan", "validate_sample", "collate_text", "collate_vision"]


class SampleError(ValueError):
    """A training sample is inconsistent (e.g. image tokens vs image patches)."""


def _sample_name(sample: dict, index: int | None) -> str:
    sid = sample.get("id")
    return f"sample {sid!r}" if sid is not None else f"sample at index {index}"


def tokens_per_image(grid_thw: np.ndarray, spatial_merge_size: int) -> np.ndarray:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return grid.prod(-1) // (spatial_merge_size**2)


def validate_sample(
    sample: dict, *, image_token_id: int, spatial_merge_size: int, index: int | None = None
) -> None:
    """Raise :class:`SampleError` naming the sample if its fields disagree."""
    name = _sample_name(sample, index)
    if "input_ids" not in sample:
        raise SampleError(f"{name} has no 'input_ids'.")
    ids = np.asarray(sample["input_ids"])
    if ids.ndim != 1 or ids.size < 2:
        raise SampleError(f"{name}: 'input_ids' must be a 1-D sequence of >= 2 tokens.")
    labels = sample.get("labels")
    if labels is not None and np.asarray(labels).shape != ids.shape:
        raise SampleError(f"{name}: 'labels' and 'input_ids' have different lengths.")
    n_image_tokens = int((ids == image_token_id).sum())
    grid = sample.get("image_grid_thw")
    pixels = sample.get("pixel_values")
    if (grid is None) != (pixels is None):
        raise SampleError(f"{name}: give both 'pixel_values' and 'image_grid_thw' or neither.")
    n_embeddings = 0
    if grid is not None:
        grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
        if (grid[:, 1:] % spatial_merge_size).any():
            raise SampleError(
                f"{name}: image_grid_thw {grid.tolist()} has h or w not divisible by "
                f"spatial_merge_size={spatial_merge_size}."
            )
        n_embeddings = int(tokens_per_image(grid, spatial_merge_size).sum())
        n_patches = int(grid.prod(-1).sum())
        if np.shape(pixels)[0] != n_patches:
            raise SampleError(
                f"{name}: pixel_values has {np.shape(pixels)[0]} patches but image_grid_thw "
                f"{grid.tolist()} needs {n_patches}."
            )
    if n_image_tokens != n_embeddings:
        raise SampleError(
            f"{name}: {n_image_tokens} image tokens (id {image_token_id}) in input_ids but its "
            f"images give {n_embeddings} embeddings; expand each image placeholder to "
            "t*h*w/merge^2 tokens as the Qwen2.5-VL processor does."
        )


def sample_labels(sample: dict, image_token_id: int) -> np.ndarray:
    ids = np.asarray(sample["input_ids"], dtype=np.int64)
    if sample.get("labels") is not None:
        return np.asarray(sample["labels"], dtype=np.int64)
    labels = ids.copy()
    labels[ids == image_token_id] = IGNORE_INDEX
    return labels


def count_label_tokens(labels: np.ndarray) -> int:
    """Tokens that enter the loss after the causal shift."""
    return int((np.asarray(labels)[1:] != IGNORE_INDEX).sum())


@dataclass
class TextBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    image_grid_thw: torch.Tensor | None


def collate_text(items: Sequence[dict], pad_token_id: int = 0) -> TextBatch:
    """Right-pad ``input_ids``/``labels`` of the items (dicts with ``input_ids``, ``labels``,
    ``image_grid_thw``) into one batch."""
    if not items:
        raise ValueError("collate_text got an empty batch.")
    length = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), length), dtype=torch.long)
    grids = []
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        ids[row, :n] = torch.as_tensor(np.asarray(it["input_ids"], dtype=np.int64))
        labels[row, :n] = torch.as_tensor(np.asarray(it["labels"], dtype=np.int64))
        mask[row, :n] = 1
        if it.get("image_grid_thw") is not None and len(it["image_grid_thw"]):
            grids.append(torch.as_tensor(np.asarray(it["image_grid_thw"], dtype=np.int64)))
    grid = torch.cat([g.reshape(-1, 3) for g in grids]) if grids else None
    return TextBatch(ids, mask, labels, grid)


def collate_vision(samples: Sequence[dict]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Concatenate the samples' patches and grids; ``(None, None)`` when there is no image."""
    pix, grids = [], []
    for s in samples:
        if s.get("image_grid_thw") is not None:
            pix.append(torch.as_tensor(np.asarray(s["pixel_values"], dtype=np.float32)))
            grids.append(torch.as_tensor(np.asarray(s["image_grid_thw"], dtype=np.int64)))
    if not grids:
        return None, None
    return torch.cat(pix), torch.cat([g.reshape(-1, 3) for g in grids])


def text_item(sample: dict, image_token_id: int) -> dict[str, Any]:
    """The part of a sample that the text group needs (sent along with the embeddings)."""
    grid = sample.get("image_grid_thw")
    return {
        "id": sample.get("id"),
        "input_ids": np.asarray(sample["input_ids"], dtype=np.int64),
        "labels": sample_labels(sample, image_token_id),
        "image_grid_thw": None if grid is None else np.asarray(grid, np.int64).reshape(-1, 3),
    }


@dataclass(frozen=True)
class BatchPlan:
    """Which samples form each global batch and which replica gets which of them.

    Step ``s`` of epoch ``e`` takes positions ``[s*B, (s+1)*B)`` of a permutation of the
    dataset seeded by ``(seed, e)``; the last incomplete batch of an epoch is dropped. Vision
    replica ``d`` gets the ``d``-th contiguous ``B / vision_dp`` slice, text replica ``t``
    the ``t``-th ``B / text_dp`` slice; vision replica ``d`` sends each text replica the
    overlap of their slices (M:N routing).

    Example:
        >>> plan = BatchPlan(num_samples=8, global_batch_size=4, vision_dp=2, text_dp=1)
        >>> plan.routes_from_vision(1)
        [(0, 2, 4)]
    """

    num_samples: int
    global_batch_size: int
    vision_dp: int
    text_dp: int
    seed: int = 0
    shuffle: bool = False

    def __post_init__(self) -> None:
        for name, dp in (("vision", self.vision_dp), ("text", self.text_dp)):
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

    def _span(self, rank: int, dp: int) -> tuple[int, int]:
        per = self.global_batch_size // dp
        return rank * per, (rank + 1) * per

    def vision_span(self, rank: int) -> tuple[int, int]:
        return self._span(rank, self.vision_dp)

    def text_span(self, rank: int) -> tuple[int, int]:
        return self._span(rank, self.text_dp)

    def routes_from_vision(self, vision_rank: int) -> list[tuple[int, int, int]]:
        """``(text_rank, lo, hi)``: batch positions ``[lo, hi)`` go to ``text_rank``."""
        return self._overlaps(self.vision_span(vision_rank), self.text_span, self.text_dp)

    def routes_to_text(self, text_rank: int) -> list[tuple[int, int, int]]:
        """``(vision_rank, lo, hi)``: batch positions ``[lo, hi)`` come from ``vision_rank``."""
        return self._overlaps(self.text_span(text_rank), self.vision_span, self.vision_dp)

    @staticmethod
    def _overlaps(span, other_span, n_other) -> list[tuple[int, int, int]]:
        out = []
        for r in range(n_other):
            lo, hi = other_span(r)
            lo, hi = max(lo, span[0]), min(hi, span[1])
            if lo < hi:
                out.append((r, lo, hi))
        return out
