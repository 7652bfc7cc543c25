"""Qwen3-VL-MoE (see ``adapter.py``)."""

from ray_disagg.models.qwen3_vl_moe.adapter import Qwen3VLMoeAdapter
from ray_disagg.models.qwen3_vl_moe.flavors import tiny_qwen3_vl_moe_config

__all__ = ["Qwen3VLMoeAdapter", "tiny_qwen3_vl_moe_config"]
