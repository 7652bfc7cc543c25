"""InternVL's conversations: the template's context token becomes ``<img>`` + context
tokens for every tile + ``</img>``; a video's ``<video>`` becomes one ``Frame{i}: <img>``
+ context tokens + ``</img>`` run per frame (``InternVLProcessor.replace_video_token``),
each frame a tile of ``pixel_values``: images' tiles and videos' frames in the order of
their marks (the model has no video input). Frames are sampled from a shift (its
``initial_shift``, by default half a step)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ray_disagg.models.llava_common.processing import TileProcessing
from ray_disagg.models.processing import token_text

__all__ = ["InternVLProcessing"]


def _image_marks(tokenizer) -> tuple[str, str]:
    """InternVL's begin / end of an image (or a frame)."""
    start = getattr(tokenizer, "start_image_token", None) or "<img>"
    return start, getattr(tokenizer, "end_image_token", None) or "</img>"


class InternVLProcessing(TileProcessing):
    """Processing hooks of InternVL."""

    template_newline = True  # "<IMG_CONTEXT>\n"
    reads_video_processor = True

    def media_mark(self, tokenizer, kind):
        if kind == "video":
            return getattr(tokenizer, "video_token", None) or "<video>"
        return super().media_mark(tokenizer, kind)

    def tile_image(self, tokenizer, encoded, alone):
        c = self.config
        pixels = np.asarray(encoded["pixel_values"], dtype=np.float32)
        start, end = _image_marks(tokenizer)
        image = token_text(tokenizer, c.image_token_id)
        return pixels, f"{start}{image * (c.image_seq_length * len(pixels))}{end}", None

    def video_initial_shift(self, settings):
        from ray_disagg.data.video import video_setting

        return video_setting(settings, "initial_shift", True)

    def tile_video_text(self, tokenizer, frames):
        from transformers.models.internvl.processing_internvl import InternVLProcessor

        start, end = _image_marks(tokenizer)
        me = SimpleNamespace(
            start_image_token=start,
            end_image_token=end,
            image_token=token_text(tokenizer, self.config.image_token_id),
            image_seq_length=self.config.image_seq_length,
        )
        return InternVLProcessor.replace_video_token(me, {"pixel_values_videos": [frames]}, 0)

    def tile_fields(self, items, order):
        """One ``pixel_values``: every image's tiles and video's frames in mark order."""
        todo = {kind: iter(v) for kind, v in items.items()}
        tiles = [next(todo[kind])[0] for kind in order]
        return {"pixel_values": np.concatenate(tiles)} if tiles else {}
