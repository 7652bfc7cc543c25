"""Tiny Qwen3-VL-MoE configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLMoeConfig

from ray_disagg.models.qwen3_vl.flavors import tiny_qwen3_vl_config

__all__ = ["tiny_qwen3_vl_moe_config"]


def tiny_qwen3_vl_moe_config(
    *,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 24,
    mlp_only_layers: tuple[int, ...] = (1,),
    output_router_logits: bool = True,
    router_aux_loss_coef: float = 0.01,
    **overrides: Any,
) -> Qwen3VLMoeConfig:
    """A tiny Qwen3-VL-MoE config: the tiny Qwen3-VL (DeepStack, 3 text layers) whose
    decoder layers but ``mlp_only_layers`` route each token to ``top_k`` of
    ``num_experts`` experts; the router's auxiliary loss is on (HF's default is off).

    Example:
        >>> c = tiny_qwen3_vl_moe_config()
        >>> c.text_config.num_experts, c.text_config.output_router_logits
        (4, True)
    """
    base = tiny_qwen3_vl_config(**overrides).to_dict()
    text = dict(
        base["text_config"],
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        output_router_logits=output_router_logits,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    for key in ("model_type", "transformers_version", "architectures"):
        text.pop(key, None)
    vision = {k: v for k, v in base["vision_config"].items() if k != "model_type"}
    keep = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **{k: base[k] for k in keep})
