"""Qwen2.5-VL: windowed vision tower (window order inside the tower, a few full-attention
blocks), mrope LLM whose video positions scale with ``second_per_grid_ts``."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from ray_disagg.models.qwen_vl import QwenVLAdapter, WindowOrderPlan, mrope_section

__all__ = ["Qwen2_5_VLAdapter", "tiny_qwen2_5_vl_config"]


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
    head_dim = text_hidden // text_heads
    if head_dim % 2:
        raise ValueError("text_hidden / text_heads must be even for rotary embeddings.")
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=text_layers,
            num_attention_heads=text_heads,
            num_key_value_heads=text_kv_heads,
            max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": mrope_section(head_dim),
                "rope_theta": 1e4,
            },
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=vision_heads,
            out_hidden_size=text_hidden,
            patch_size=patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=window_size,
            fullatt_block_indexes=list(fullatt_block_indexes),
            in_channels=3,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
        vision_end_token_id=103,
        **overrides,
    )


class Qwen2_5_VLAdapter(QwenVLAdapter):
    model_type = "qwen2_5_vl"
    config_class = Qwen2_5_VLConfig
    hf_class = Qwen2_5_VLForConditionalGeneration
    tower_plan = WindowOrderPlan()
    llm_extra_fields = ("second_per_grid_ts",)
    tiny_config = staticmethod(tiny_qwen2_5_vl_config)

    def tower_tp_plan(self, part):
        return {
            "attn.qkv.q": "colwise",
            "attn.qkv.k": "colwise",
            "attn.qkv.v": "colwise",
            "attn.proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }
