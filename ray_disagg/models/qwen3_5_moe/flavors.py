"""Tiny Qwen3.5-MoE configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3_5MoeConfig

from ray_disagg.models.qwen3_5.flavors import TOKEN_IDS, tiny_qwen3_5_text, tiny_vision

__all__ = ["tiny_qwen3_5_moe_config"]


def tiny_qwen3_5_moe_config(
    *,
    num_experts: int = 4,
    top_k: int = 2,
    output_router_logits: bool = True,
    router_aux_loss_coef: float = 0.01,
    **overrides: Any,
) -> Qwen3_5MoeConfig:
    """A tiny Qwen3.5-MoE config: the tiny Qwen3.5 whose every layer routes each token to
    ``top_k`` of ``num_experts`` experts plus a gated shared expert; the router's
    auxiliary loss is on (HF's default is off).

    Example:
        >>> tiny_qwen3_5_moe_config().text_config.num_experts
        4
    """
    text = tiny_qwen3_5_text(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    text.pop("intermediate_size")
    return Qwen3_5MoeConfig(
        text_config=text, vision_config=tiny_vision(64), **TOKEN_IDS, **overrides
    )
