"""Qwen2-VL: every vision block attends over whole images/frames in natural order
(LayerNorm, ``fc1``/``fc2``); mrope LLM without time scaling."""

from __future__ import annotations

from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from ray_disagg.models.qwen2_vl.flavors import tiny_qwen2_vl_config
from ray_disagg.models.qwen2_vl.parallelize import TOWER_MLP, TOWER_PLAN
from ray_disagg.models.qwen_common.adapter import QwenVLAdapter

__all__ = ["Qwen2VLAdapter"]


class Qwen2VLAdapter(QwenVLAdapter):
    model_type = "qwen2_vl"
    config_class = Qwen2VLConfig
    hf_class = Qwen2VLForConditionalGeneration
    tower_plan = TOWER_PLAN
    tower_mlp = TOWER_MLP
    cp_parts = ("text",)
    tiny_config = staticmethod(tiny_qwen2_vl_config)
