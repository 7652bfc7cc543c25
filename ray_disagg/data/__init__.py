"""Training samples: their format and checks, small example sets and LLaVA-style files.

A sample is a dict (a row of a list, a ``datasets.Dataset``, a Ray Data row):
``input_ids`` (placeholders already expanded, one token per encoder output row),
optional ``labels`` (``-100`` where no loss is taken), optional ``id`` (named in errors),
and the family's modality fields (Qwen: ``pixel_values`` + ``image_grid_thw``,
``pixel_values_videos`` + ``video_grid_thw``; Omni adds ``input_features`` +
``feature_attention_mask``). Each family's adapter validates them (``ray_disagg.models``).
"""

from ray_disagg.models.base import SampleError
from ray_disagg.pipeline.assignment import BatchPlan, balanced_split, count_label_tokens

__all__ = ["SampleError", "BatchPlan", "count_label_tokens", "balanced_split"]
