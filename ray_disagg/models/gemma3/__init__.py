"""Gemma 3 (see ``adapter.py``)."""

from ray_disagg.models.gemma3.adapter import Gemma3Adapter
from ray_disagg.models.gemma3.flavors import tiny_gemma3_config

__all__ = ["Gemma3Adapter", "tiny_gemma3_config"]
