"""The sizes the tiny configs share (CPU-sized, random init, no download): one builder
per block, so that each family's ``flavors.py`` states only what is its own. Each
returns the block's config dict; keywords add fields or replace the shared ones."""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_VISION_IDS", "tiny_decoder", "tiny_siglip", "tiny_vit"]

TINY_VISION_IDS = dict(
    image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103
)
"""The image, video, vision start and vision end token ids of the tiny configs."""


def tiny_decoder(
    *,
    vocab_size: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    **fields: Any,
) -> dict:
    """A ``text_config``: ``hidden`` wide (MLP ``2 * hidden``), ``layers`` deep, ``heads``
    query and ``kv_heads`` key/value heads, 1024 positions, pad id 0.

    Example:
        >>> tiny_decoder(layers=4, model_type="qwen2")["num_hidden_layers"]
        4
    """
    block = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        pad_token_id=0,
    )
    return {**block, **fields}


def tiny_vit(**fields: Any) -> dict:
    """A ViT ``vision_config``: 2 blocks 32 wide, 4 heads, on 16x16 images (4x4 patches
    of 4 pixels)."""
    block = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
    )
    return {**block, **fields}


def tiny_siglip(**fields: Any) -> dict:
    """:func:`tiny_vit` as SigLIP's tower, without the pooling head."""
    return tiny_vit(model_type="siglip_vision_model", vision_use_head=False, **fields)
