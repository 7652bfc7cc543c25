"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-VL's tower with DeepStack and a
decoder whose MLPs are sparse mixture-of-experts blocks (a softmax top-k router over
``num_experts`` experts stored as 3-D tensors). With ``output_router_logits`` the
training loss adds the router's auxiliary loss over the global batch
(:mod:`ray_disagg.models.moe`)."""

from __future__ import annotations

from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from ray_disagg.models.qwen3_vl.adapter import Qwen3VLAdapter
from ray_disagg.models.qwen3_vl_moe.flavors import tiny_qwen3_vl_moe_config
from ray_disagg.models.qwen3_vl_moe.parallelize import MOE_LLM_TP_PLAN
from ray_disagg.models.qwen_common.adapter import RoutedLLMMixin

__all__ = ["Qwen3VLMoeAdapter", "moe_head_counts"]


def moe_head_counts(text_config) -> dict[str, int]:
    """The sizes an LLM TP degree must divide in an MoE decoder (experts stay whole)."""
    counts = {
        "num_attention_heads": text_config.num_attention_heads,
        "num_key_value_heads": text_config.num_key_value_heads,
    }
    if getattr(text_config, "mlp_only_layers", None):
        counts["intermediate_size"] = text_config.intermediate_size
    return counts


class Qwen3VLMoeAdapter(RoutedLLMMixin, Qwen3VLAdapter):
    model_type = "qwen3_vl_moe"
    config_class = Qwen3VLMoeConfig
    hf_class = Qwen3VLMoeForConditionalGeneration
    tiny_config = staticmethod(tiny_qwen3_vl_moe_config)

    def llm_tp_plan(self):
        return dict(MOE_LLM_TP_PLAN)

    def head_counts(self, part):
        if part == "vision":
            return super().head_counts(part)
        return moe_head_counts(self.config.text_config)
