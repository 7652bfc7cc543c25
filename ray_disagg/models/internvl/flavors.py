"""Tiny InternVL configs for CPU tests."""

from __future__ import annotations

from transformers import InternVLConfig

from ray_disagg.models.flavors import tiny_decoder, tiny_vit

__all__ = ["tiny_internvl_config"]


def tiny_internvl_config(**overrides) -> InternVLConfig:
    """A CPU-sized InternVL3: a 2-block InternViT on 16x16 tiles (4x4 patches of 4
    pixels, CLS dropped), pixel shuffle 0.5 to 4 tokens per tile, an MLP projector and a
    2-layer Qwen2 decoder; embeddings tied (InternVL's default). Token id 100 is the
    image context token."""
    kwargs = dict(
        vision_config=tiny_vit(),
        text_config=tiny_decoder(model_type="qwen2", bos_token_id=1, eos_token_id=2),
        image_token_id=100,
        image_seq_length=4,
        downsample_ratio=0.5,
    )
    return InternVLConfig(**{**kwargs, **overrides})
