"""Qwen3.5-MoE: Qwen3.5 (see ``qwen3_5/adapter.py``) whose every decoder layer is a sparse
mixture of experts with a gated shared expert; with ``output_router_logits`` the training
loss adds the router's auxiliary loss over the global batch
(:mod:`ray_disagg.models.moe`). Under text TP the experts, the router and the shared
expert stay whole on every tp rank (``qwen3_5/parallelize.py``)."""

from __future__ import annotations

from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from ray_disagg.models.qwen3_5.adapter import Qwen3_5Adapter
from ray_disagg.models.qwen3_5.parallelize import linear_attention_counts
from ray_disagg.models.qwen3_5_moe.flavors import tiny_qwen3_5_moe_config
from ray_disagg.models.qwen3_vl_moe.adapter import moe_head_counts
from ray_disagg.models.qwen_common.adapter import RoutedLLMMixin

__all__ = ["Qwen3_5MoeAdapter"]


class Qwen3_5MoeAdapter(RoutedLLMMixin, Qwen3_5Adapter):
    model_type = "qwen3_5_moe"
    config_class = Qwen3_5MoeConfig
    hf_class = Qwen3_5MoeForConditionalGeneration
    tiny_config = staticmethod(tiny_qwen3_5_moe_config)

    def head_counts(self, part):
        if part == "vision":
            return super().head_counts(part)
        text = self.config.text_config
        return {**moe_head_counts(text), **linear_attention_counts(text)}
