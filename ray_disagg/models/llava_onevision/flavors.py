"""Tiny LLaVA-OneVision configs for CPU tests."""

from __future__ import annotations

from transformers import LlavaOnevisionConfig

from ray_disagg.models.flavors import tiny_decoder, tiny_siglip

__all__ = ["tiny_llava_onevision_config"]


def tiny_llava_onevision_config(**overrides) -> LlavaOnevisionConfig:
    """A CPU-sized LLaVA-OneVision: a 2-block SigLIP tower on 16x16 tiles (4x4 patches of
    4 pixels), any-resolution crops on a 16-pixel grid up to 32x32, an MLP projector and a
    2-layer Qwen2 decoder (untied, as the released models). Token ids 100 and 101 are the
    image and video tokens."""
    kwargs = dict(
        vision_config=tiny_siglip(),
        text_config=tiny_decoder(model_type="qwen2", bos_token_id=1, eos_token_id=2),
        image_token_index=100,
        video_token_index=101,
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
    )
    return LlavaOnevisionConfig(**{**kwargs, **overrides})
