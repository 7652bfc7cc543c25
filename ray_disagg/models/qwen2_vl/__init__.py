"""Qwen2-VL (see ``adapter.py``)."""

from ray_disagg.models.qwen2_vl.adapter import Qwen2VLAdapter
from ray_disagg.models.qwen2_vl.flavors import tiny_qwen2_vl_config

__all__ = ["Qwen2VLAdapter", "tiny_qwen2_vl_config"]
