"""Tiny Qwen3-VL configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLConfig

from ray_disagg.models.qwen_common.flavors import TINY_VISION_IDS, tiny_text_config, tiny_tower

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
        vision_config=tiny_tower(
            depth=vision_depth,
            hidden=vision_hidden,
            heads=vision_heads,
            out_hidden=text_hidden,
            patch_size=patch_size,
            num_position_embeddings=16,
            deepstack_visual_indexes=list(deepstack_visual_indexes),
        ),
        **TINY_VISION_IDS,
        **overrides,
    )
