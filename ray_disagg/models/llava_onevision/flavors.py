"""Tiny LLaVA-OneVision configs for CPU tests."""

from __future__ import annotations

from transformers import LlavaOnevisionConfig

__all__ = ["tiny_llava_onevision_config"]


def tiny_llava_onevision_config(**overrides) -> LlavaOnevisionConfig:
    """A CPU-sized LLaVA-OneVision: a 2-block SigLIP tower on 16x16 tiles (4x4 patches of
    4 pixels), any-resolution crops on a 16-pixel grid up to 32x32, an MLP projector and a
    2-layer Qwen2 decoder (untied, as the released models). Token ids 100 and 101 are the
    image and video tokens."""
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        vision_use_head=False,
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
        image_token_index=100,
        video_token_index=101,
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
    )
    return LlavaOnevisionConfig(**{**kwargs, **overrides})
