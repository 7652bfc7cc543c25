"""Qwen3.5 (see ``adapter.py``)."""

from ray_disagg.models.qwen3_5.adapter import Qwen3_5Adapter
from ray_disagg.models.qwen3_5.flavors import tiny_qwen3_5_config

__all__ = ["Qwen3_5Adapter", "tiny_qwen3_5_config"]
