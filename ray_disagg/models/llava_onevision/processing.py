"""LLaVA-OneVision's conversations: ``<image>`` is repeated once per row the model makes
of the image (crops alone in their sample, one base tile when the sample has several
images); ``<video>`` once per row it makes of the video (the pooled rows of every frame
and one ``image_newline`` row, ``LlavaOnevisionProcessor.replace_video_token``), the
frames in ``pixel_values_videos`` ``(frames, C, S, S)``. Frames are sampled from frame 0."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ray_disagg.models.llava_common.processing import TileProcessing
from ray_disagg.models.processing import token_text

__all__ = ["OnevisionProcessing"]


class OnevisionProcessing(TileProcessing):
    """Processing hooks of LLaVA-OneVision (``image_tiles`` / ``image_rows``: its
    adapter's)."""

    template_newline = True  # "<image>\n"
    reads_video_processor = True

    def tile_image(self, tokenizer, encoded, alone):
        pixels = np.asarray(encoded["pixel_values"], dtype=np.float32)
        size = tuple(int(x) for x in np.ravel(encoded["image_sizes"])[:2])
        tiles = pixels.reshape(-1, *pixels.shape[-3:])[: self.image_tiles(size, alone)]
        image = token_text(tokenizer, self.config.image_token_id)
        return tiles, image * self.image_rows(size, alone), size

    def tile_video_text(self, tokenizer, frames):
        from transformers.models.llava_onevision.processing_llava_onevision import (
            LlavaOnevisionProcessor,
        )

        v = self.config.vision_config
        me = SimpleNamespace(
            num_image_tokens=(v.image_size // v.patch_size) ** 2,
            video_token=token_text(tokenizer, self.config.video_token_id),
        )
        return LlavaOnevisionProcessor.replace_video_token(me, {"pixel_values_videos": [frames]}, 0)

    def tile_fields(self, items, order):
        """Also each image's size in ``image_sizes``."""
        out = super().tile_fields(items, order)
        if items["image"]:
            sizes = np.asarray([i[2] for i in items["image"]], dtype=np.int64)
            out = {"pixel_values": out.pop("pixel_values"), "image_sizes": sizes, **out}
        return out
