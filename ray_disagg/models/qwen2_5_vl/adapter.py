"""Qwen2.5-VL: windowed vision tower (window order inside the tower, a few full-attention
blocks), mrope LLM whose video positions scale with ``second_per_grid_ts``."""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from ray_disagg.models.qwen2_5_vl.flavors import tiny_qwen2_5_vl_config
from ray_disagg.models.qwen2_5_vl.parallelize import TOWER_MLP, TOWER_PLAN
from ray_disagg.models.qwen_common.adapter import QwenVLAdapter
from ray_disagg.models.qwen_common.decode import QwenDecodeMixin

__all__ = ["Qwen2_5_VLAdapter"]


class Qwen2_5_VLAdapter(QwenDecodeMixin, QwenVLAdapter):
    model_type = "qwen2_5_vl"
    config_class = Qwen2_5_VLConfig
    hf_class = Qwen2_5_VLForConditionalGeneration
    tower_plan = TOWER_PLAN
    tower_mlp = TOWER_MLP
    llm_extra_fields = ("second_per_grid_ts",)
    windowed_tower = True
    gated_tower_mlp = True
    cp_parts = ("text",)
    tiny_config = staticmethod(tiny_qwen2_5_vl_config)
