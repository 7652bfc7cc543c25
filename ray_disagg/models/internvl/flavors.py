"""Tiny InternVL configs for CPU tests."""

from __future__ import annotations

from transformers import InternVLConfig

__all__ = ["tiny_internvl_config"]


def tiny_internvl_config(**overrides) -> InternVLConfig:
    """A CPU-sized InternVL3: a 2-block InternViT on 16x16 tiles (4x4 patches of 4
    pixels, CLS dropped), pixel shuffle 0.5 to 4 tokens per tile, an MLP projector and a
    2-layer Qwen2 decoder; embeddings tied (InternVL's default). Token id 100 is the
    image context token."""
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
    )
    text = dict(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs = dict(
        vision_config=vision,
        text_config=text,
        image_token_id=100,
        image_seq_length=4,
        downsample_ratio=0.5,
    )
    return InternVLConfig(**{**kwargs, **overrides})
