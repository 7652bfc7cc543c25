"""Qwen3-VL's parallel plans: a natural-order Ulysses tower whose slices also get their
rows of the position-embedding interpolation taps; vision TP with ``linear_fc1``
column-wise and ``linear_fc2`` row-wise; the decoder's per-head ``q_norm``/``k_norm``
(their TP gradients are partial sums)."""

from __future__ import annotations

from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from ray_disagg.models.qwen_common.parallelize import NaturalOrderPlan

__all__ = ["PER_HEAD_NORMS", "TOWER_MLP", "TOWER_PLAN", "Qwen3VLPlan"]


class Qwen3VLPlan(NaturalOrderPlan):
    """Natural order; each slice also gets its rows of the position-embedding taps."""

    def local_kwargs(self, tower, grid_thw, index, lo, hi):
        kwargs = super().local_kwargs(tower, grid_thw, index, lo, hi)
        taps, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=tower.num_grid_per_side,
            mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners,
            spatial_merge_size=tower.config.spatial_merge_size,
        )
        return {**kwargs, "interp_indices": taps[index], "interp_weights": weights[index]}


TOWER_PLAN = Qwen3VLPlan()
TOWER_MLP = (("linear_fc1",), "linear_fc2")
PER_HEAD_NORMS = ("q_norm", "k_norm")
