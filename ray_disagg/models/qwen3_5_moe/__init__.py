"""Qwen3.5-MoE (see ``adapter.py``)."""

from ray_disagg.models.qwen3_5_moe.adapter import Qwen3_5MoeAdapter
from ray_disagg.models.qwen3_5_moe.flavors import tiny_qwen3_5_moe_config

__all__ = ["Qwen3_5MoeAdapter", "tiny_qwen3_5_moe_config"]
