"""Tiny Qwen3.5 configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3_5Config

from ray_disagg.models.flavors import TINY_VISION_IDS, tiny_decoder
from ray_disagg.models.qwen_common.flavors import mrope_section, tiny_tower

__all__ = ["tiny_qwen3_5_config", "tiny_qwen3_5_text"]


def tiny_qwen3_5_text(
    *, vocab_size: int = 128, hidden: int = 64, heads: int = 4, kv_heads: int = 2, **extra
) -> dict:
    """The ``text_config`` dict of the tiny Qwen3.5 families: 4 layers alternating Gated
    DeltaNet linear attention and gated full attention (head_dim 32, a quarter of it
    rotary, mrope over that quarter)."""
    head_dim, partial = 32, 0.25
    return tiny_decoder(
        vocab_size=vocab_size,
        hidden=hidden,
        layers=4,
        heads=heads,
        kv_heads=kv_heads,
        layer_types=["linear_attention", "full_attention"] * 2,
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": partial,
            "mrope_section": mrope_section(int(head_dim * partial)),
            "mrope_interleaved": True,
        },
        **extra,
    )


def tiny_vision(out_hidden: int) -> dict:
    """The tiny Qwen3.5 tower: Qwen3-VL's without DeepStack."""
    return tiny_tower(
        depth=3, hidden=32, heads=4, out_hidden=out_hidden, patch_size=4, num_position_embeddings=16
    )


TOKEN_IDS = TINY_VISION_IDS


def tiny_qwen3_5_config(**overrides: Any) -> Qwen3_5Config:
    """A tiny Qwen3.5 config (ids 100-103 as in the other tiny Qwen configs).

    Example:
        >>> tiny_qwen3_5_config().text_config.layer_types[:2]
        ['linear_attention', 'full_attention']
    """
    return Qwen3_5Config(
        text_config=tiny_qwen3_5_text(),
        vision_config=tiny_vision(64),
        **TOKEN_IDS,
        **overrides,
    )
