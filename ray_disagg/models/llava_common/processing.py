"""The LLaVA-shaped families' conversations (:class:`~ray_disagg.models.processing.ProcessingHooks`,
media expanded in the text, on the CPU route: the family's PIL image processor, no
torchvision): each image or video mark of the rendered chat template becomes the text the
family's processor puts there, and the tiles the fields the model reads. A family sets
its image text (:meth:`~ray_disagg.models.processing.ProcessingHooks.tile_image`) and,
with a video input, its video text; videos' settings come from its
``video_preprocessor_config.json`` (InternVL's video processor class needs torchvision)."""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["TileProcessing"]


class TileProcessing:
    """Processing hooks shared by the LLaVA-shaped families (a mixin of their adapter)."""

    tiled_media = True

    def load_video_processor(self, directory):
        """The mapping of ``video_preprocessor_config.json`` in ``directory`` (``None``
        without one: the frames take the image processor's settings)."""
        path = os.path.join(directory, "video_preprocessor_config.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def tile_fields(self, items, order):
        """``pixel_values`` of the images' tiles; ``pixel_values_videos`` of the videos'
        frames and each video's frame count in ``video_frames``."""
        images, videos, out = items["image"], items["video"], {}
        if images:
            out["pixel_values"] = np.concatenate([i[0] for i in images])
        if videos:
            out["pixel_values_videos"] = np.concatenate([v[0] for v in videos])
            out["video_frames"] = np.asarray([len(v[0]) for v in videos], dtype=np.int64)
        return out
