"""Tiny Qwen3-VL configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLConfig

from ray_disagg.models.qwen_common.flavors import tiny_text_config

__all__ = ["tiny_qwen3_vl_config"]


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
