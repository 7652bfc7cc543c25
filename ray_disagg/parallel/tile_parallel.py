"""Sequence parallelism for tile towers (InternViT, SigLIP: InternVL, LLaVA-OneVision,
Gemma 3), whose attention runs within fixed-size tiles.

The tiles of one call (one microbatch: every sample's tiles in sample order, an image's
tiles in its order; video frames are tiles too: InternVL's among the images' in media
order, LLaVA-OneVision's after every image tile) split into ``sp`` contiguous runs of
whole tiles, as even as tile counts allow, lower ranks never emptier
(:func:`split_tiles`). Each SP rank copies only its own tiles' pixels to the device
(:class:`~ray_disagg.parallel.ulysses.HostRows`) and runs the family's per-tile features
on them through the unmodified HF modules: the tower (a tile attends within itself, so
this is exact with no collective inside the tower) and whatever else is per tile
(InternVL's pixel shuffle and projector, Gemma 3's pooling and projection,
LLaVA-OneVision's projector). The rows are then gathered to SP rank 0 in tile
order (:class:`~ray_disagg.parallel.ulysses.GatherToLeader`), where what spans an image's
tiles runs (LLaVA-OneVision's unpadding and ``image_newline`` rows; its video frames'
pooling and one ``image_newline`` row per video).

A rank with no tile (fewer tiles than ranks) runs the features on a stand-in tile (the
call's first) and cuts its rows to 0 before the gather, so it joins every FSDP2
all-gather and reduce-scatter of the tower like the other ranks; its gradients are zero.
The tower's weights are replicated over ``sp``: each rank's gradients are partial sums
over its tiles, summed by the group's gradient reduction (the all-reduce over ``dp x sp``,
or FSDP2's reduce-scatter over it), as for Ulysses SP.

No per-rank limit applies: a rank holds at most ``ceil(tiles / sp)`` whole tiles of a
microbatch whose patches ``max_patches_per_microbatch`` already caps, and a tile is never
split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_disagg.parallel.ulysses import GatherToLeader, HostRows, plan_slices

__all__ = ["TileSplit", "split_tiles", "tile_sp_forward"]


@dataclass(frozen=True)
class TileSplit:
    """Rank ``r`` of the SP group holds the tiles ``[bounds[r], bounds[r + 1])``; ``rank``
    is this rank."""

    bounds: tuple[int, ...]
    rank: int

    @property
    def counts(self) -> list[int]:
        """Tiles of each rank, in rank order."""
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    @property
    def local(self) -> tuple[int, int]:
        """``(lo, hi)`` of the tiles this rank runs: its own, or the stand-in tile
        ``(0, 1)`` when it has none."""
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return (lo, hi) if hi > lo else (0, 1)

    @property
    def stand_in(self) -> bool:
        """Whether this rank has no tile of its own (it runs the stand-in tile)."""
        return self.counts[self.rank] == 0

    def __post_init__(self):
        if self.bounds[-1] < 1:
            raise ValueError(
                "tile sequence parallelism needs at least one tile per call; call it only "
                "for a microbatch with images (the adapters return no rows without)."
            )


def split_tiles(tiles: int, sp_size: int, rank: int) -> TileSplit:
    """Contiguous runs of whole tiles for the ``sp_size`` ranks (each boundary the closest
    to an equal share; ties to the later one, so that rank 0 is never emptier).

    Example:
        >>> split_tiles(5, 2, 1).counts, split_tiles(1, 2, 1).stand_in
        ([3, 2], True)
    """
    return TileSplit(plan_slices(list(range(tiles + 1)), sp_size).bounds, rank)


def _tiles(pixels: torch.Tensor | HostRows) -> int:
    return int(pixels.starts[-1]) if isinstance(pixels, HostRows) else int(pixels.shape[0])


def tile_sp_forward(
    features: Callable[[torch.Tensor], torch.Tensor],
    pixels: torch.Tensor | HostRows,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The per-tile ``features`` of every tile in ``pixels`` with this rank running only
    its own tiles (``group``: the SP process group).

    ``features`` maps ``(t, C, S, S)`` pixels (on the device, float32: the caller casts)
    to ``(t, R, D)``, ``R`` rows per tile, the same for every tile. ``pixels``: the call's
    ``(T, C, S, S)`` tiles as a device tensor or, so that each rank copies only its own,
    as :class:`~ray_disagg.parallel.ulysses.HostRows` over the samples' arrays.

    Returns ``(T * R, D)`` in tile order on SP rank 0 and ``(0, D)`` (still in the graph)
    on the other ranks. Backward: rank 0 scatters the rows' gradient back to the ranks
    that computed them (:class:`~ray_disagg.parallel.ulysses.GatherToLeader`); a stand-in
    tile gets a zero gradient. Every rank makes the same collectives in the same order.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    split = split_tiles(_tiles(pixels), n, rank)
    lo, hi = split.local
    if isinstance(pixels, HostRows):
        local = pixels.take(torch.arange(lo, hi))
    else:
        local = pixels[lo:hi]
    out = features(local)
    rows = out.shape[1]
    flat = out.flatten(0, 1)
    if split.stand_in:
        flat = flat[:0]
    return GatherToLeader.apply(flat, [c * rows for c in split.counts], rank, group)
