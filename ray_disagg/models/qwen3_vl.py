"""Qwen3-VL: a natural-order vision tower with learned (interpolated) position embeddings
and DeepStack: the blocks in ``deepstack_visual_indexes`` feed extra mergers whose outputs
are added to the LLM's hidden states after its first decoder layers. Each DeepStack
feature crosses to the text part next to the embeddings, and its gradient comes back."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from ray_disagg.models.base import Crossing
from ray_disagg.models.qwen_vl import MODALITIES, NaturalOrderPlan, QwenVLAdapter, tiny_text_config

__all__ = ["Qwen3VLAdapter", "tiny_qwen3_vl_config"]


def tiny_qwen3_vl_config(
    *,
    vocab_size: int = 128,
    text_hidden: int = 64,
    text_layers: int = 3,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 3,
    vision_heads: int = 4,
    patch_size: int = 4,
    deepstack_visual_indexes: tuple[int, ...] = (0, 1),
    **overrides: Any,
) -> Qwen3VLConfig:
    """A tiny Qwen3-VL config with two DeepStack levels (ids 100-103 as in Qwen2.5-VL).

    Example:
        >>> tiny_qwen3_vl_config().vision_config.deepstack_visual_indexes
        [0, 1]
    """
    return Qwen3VLConfig(
        text_config=tiny_text_config(
            vocab_size=vocab_size,
            hidden=text_hidden,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            head_dim=text_hidden // text_heads,
            rope={"mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=vision_heads,
            out_hidden_size=text_hidden,
            patch_size=patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            num_position_embeddings=16,
            deepstack_visual_indexes=list(deepstack_visual_indexes),
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
        vision_end_token_id=103,
        **overrides,
    )


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


class Qwen3VLAdapter(QwenVLAdapter):
    model_type = "qwen3_vl"
    config_class = Qwen3VLConfig
    hf_class = Qwen3VLForConditionalGeneration
    tower_plan = Qwen3VLPlan()
    tower_mlp = (("linear_fc1",), "linear_fc2")
    per_head_norms = ("q_norm", "k_norm")
    tiny_config = staticmethod(tiny_qwen3_vl_config)

    @property
    def deepstack_levels(self) -> int:
        return len(self.config.vision_config.deepstack_visual_indexes)

    def crossings(self, part):
        width = self.config.text_config.hidden_size
        out = []
        for m in MODALITIES:
            out.append(Crossing(f"{m}_embeds", width))
            out += [Crossing(f"{m}_deepstack_{i}", width) for i in range(self.deepstack_levels)]
        return tuple(out)

    def placeholder_runs(self, modality, grid):
        return int(grid[:, 0].sum()) if modality == "video" else len(grid)

    def placeholder_tokens(self, modality, grid):
        if modality != "video":
            return super().placeholder_tokens(modality, grid)
        t, h, w = (int(x) for x in grid)  # each frame is its own group for get_rope_index
        frame = super().placeholder_tokens(modality, (1, h, w))
        return frame * t

    def encoder_output(self, received, modality):
        emb = received.get(f"{modality}_embeds")
        if emb is None:
            return None
        deep = [(received[f"{modality}_deepstack_{i}"],) for i in range(self.deepstack_levels)]
        return BaseModelOutputWithDeepstackFeatures(pooler_output=(emb,), deepstack_features=deep)
