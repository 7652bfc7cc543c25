"""Tiny Qwen2.5-VL configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLConfig

from ray_disagg.models.qwen_common.flavors import (
    TINY_VISION_IDS,
    tiny_text_config,
    tiny_window_tower,
)

__all__ = ["tiny_qwen2_5_vl_config"]


def tiny_qwen2_5_vl_config(
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
    window_size: int = 16,
    fullatt_block_indexes: tuple[int, ...] = (1,),
    **overrides: Any,
) -> Qwen2_5_VLConfig:
    """A randomly initialisable Qwen2.5-VL config small enough for CPU tests (no download).

    Token ids 100-103 are the image / video / vision-start / vision-end tokens.

    Example:
        >>> cfg = tiny_qwen2_5_vl_config()
        >>> cfg.vision_config.hidden_size, cfg.text_config.hidden_size
        (32, 64)
    """
    return Qwen2_5_VLConfig(
        text_config=tiny_text_config(
            vocab_size=vocab_size,
            hidden=text_hidden,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=tiny_window_tower(
            hidden=vision_hidden,
            depth=vision_depth,
            heads=vision_heads,
            out_hidden=text_hidden,
            patch_size=patch_size,
            window_size=window_size,
            fullatt=fullatt_block_indexes,
        ),
        **TINY_VISION_IDS,
        **overrides,
    )
