"""Qwen3-VL's DeepStack under context parallelism: the visual features added after the
first decoder layers follow the sequence to each ``cp`` rank's slice."""

from __future__ import annotations

__all__ = ["slice_deepstack"]


def slice_deepstack(_module, args, kwargs):
    """Forward pre-hook of the decoder stack, after
    :func:`~ray_disagg.parallel.context_parallel.enable_context_parallel`'s (which cut
    the embeddings to ``[lo, hi)``): ``visual_pos_masks`` ``(B, S)`` cut to the slice and
    each level's rows ``(n_visual, d)`` (in the mask's row-major order) to those of the
    slice's visual positions (a gather on the device; the boolean index syncs once, as
    HF's own ``_deepstack_process`` does per level; their gradients reach the crossings,
    summed over the ``cp`` ranks with the rest)."""
    cp = kwargs.get("context")
    masks, levels = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
    if cp is None or masks is None or levels is None:
        return None
    lo, hi = cp.bounds[cp.rank]
    order = masks.flatten().long().cumsum(0).view_as(masks) - 1  # each visual row's index
    local = masks[:, lo:hi]
    rows = order[:, lo:hi][local]
    kwargs["visual_pos_masks"] = local
    kwargs["deepstack_visual_embeds"] = [e.index_select(0, rows.to(e.device)) for e in levels]
    return args, kwargs
