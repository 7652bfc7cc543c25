"""Tiny Qwen2-VL configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2VLConfig

from ray_disagg.models.qwen_common.flavors import TINY_VISION_IDS, tiny_text_config

__all__ = ["tiny_qwen2_vl_config"]


def tiny_qwen2_vl_config(
    *,
    vocab_size: int = 128,
    text_hidden: int = 64,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 4,
    patch_size: int = 4,
    **overrides: Any,
) -> Qwen2VLConfig:
    """A tiny Qwen2-VL config for CPU tests (ids 100-103: image, video, vision start/end).

    Example:
        >>> tiny_qwen2_vl_config().vision_config.embed_dim
        32
    """
    return Qwen2VLConfig(
        text_config=tiny_text_config(
            vocab_size=vocab_size,
            hidden=text_hidden,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=dict(
            depth=vision_depth,
            embed_dim=vision_hidden,
            hidden_size=text_hidden,
            mlp_ratio=2,
            num_heads=vision_heads,
            patch_size=patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        **TINY_VISION_IDS,
        **overrides,
    )
