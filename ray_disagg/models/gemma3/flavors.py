"""Tiny Gemma 3 configs for CPU tests."""

from __future__ import annotations

from transformers import Gemma3Config

from ray_disagg.models.flavors import tiny_decoder, tiny_siglip

__all__ = ["tiny_gemma3_config"]


def tiny_gemma3_config(**overrides) -> Gemma3Config:
    """A CPU-sized Gemma 3: a 2-block SigLIP tower on 16x16 images (4x4 patches of 4
    pixels) pooled to 4 tokens per image, a 2-layer decoder alternating sliding-window
    (8 tokens) and full attention, tied embeddings (as every Gemma 3). Token ids 100-102
    are the image, begin-of-image and end-of-image tokens."""
    text = tiny_decoder(
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs = dict(
        vision_config=tiny_siglip(),
        text_config=text,
        mm_tokens_per_image=4,
        image_token_index=100,
        boi_token_index=101,
        eoi_token_index=102,
    )
    return Gemma3Config(**{**kwargs, **overrides})
