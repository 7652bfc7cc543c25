"""Shared pieces of the LLaVA-shaped families (tower + projector, ``inputs_embeds``)."""

from ray_disagg.models.llava_common.adapter import LlavaAdapter
from ray_disagg.models.llava_common.parallelize import LlavaParallelMixin

__all__ = ["LlavaAdapter", "LlavaParallelMixin"]
