"""Qwen2.5-Omni thinker (see ``adapter.py``)."""

from ray_disagg.models.qwen2_5_omni.adapter import Qwen2_5OmniThinkerAdapter, audio_rows
from ray_disagg.models.qwen2_5_omni.flavors import tiny_qwen2_5_omni_thinker_config

__all__ = ["Qwen2_5OmniThinkerAdapter", "audio_rows", "tiny_qwen2_5_omni_thinker_config"]
