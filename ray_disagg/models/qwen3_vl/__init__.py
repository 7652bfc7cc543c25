"""Qwen3-VL (see ``adapter.py``)."""

from ray_disagg.models.qwen3_vl.adapter import Qwen3VLAdapter
from ray_disagg.models.qwen3_vl.flavors import tiny_qwen3_vl_config
from ray_disagg.models.qwen3_vl.parallelize import Qwen3VLPlan

__all__ = ["Qwen3VLAdapter", "Qwen3VLPlan", "tiny_qwen3_vl_config"]
