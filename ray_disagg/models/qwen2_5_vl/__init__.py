"""Qwen2.5-VL (see ``adapter.py``)."""

from ray_disagg.models.qwen2_5_vl.adapter import Qwen2_5_VLAdapter
from ray_disagg.models.qwen2_5_vl.flavors import tiny_qwen2_5_vl_config

__all__ = ["Qwen2_5_VLAdapter", "tiny_qwen2_5_vl_config"]
