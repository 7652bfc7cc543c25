"""LLaVA-OneVision (see ``adapter.py``)."""

from ray_disagg.models.llava_onevision.adapter import LlavaOnevisionAdapter
from ray_disagg.models.llava_onevision.flavors import tiny_llava_onevision_config

__all__ = ["LlavaOnevisionAdapter", "tiny_llava_onevision_config"]
