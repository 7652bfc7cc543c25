"""Gemma 3's conversations: the template's ``<start_of_image>`` becomes
``"\\n\\n<start_of_image>" + <image>*n + "<end_of_image>\\n\\n"``; with pan-and-scan, the
original image's sequence and one per crop in the processor's sentence. One tile per
image and crop; no video input."""

from __future__ import annotations

import numpy as np

from ray_disagg.models.llava_common.processing import TileProcessing
from ray_disagg.models.processing import token_text

__all__ = ["Gemma3Processing"]


class Gemma3Processing(TileProcessing):
    """Processing hooks of Gemma 3."""

    def media_mark(self, tokenizer, kind):
        if kind == "video":
            return super().media_mark(tokenizer, kind)
        return token_text(tokenizer, self.config.boi_token_id)

    def tile_image(self, tokenizer, encoded, alone):
        c = self.config
        image = token_text(tokenizer, c.image_token_id)
        seq = f"\n\n{token_text(tokenizer, c.boi_token_id)}{image * c.mm_tokens_per_image}"
        seq += f"{token_text(tokenizer, c.eoi_token_id)}\n\n"
        crops = int(np.ravel(encoded.get("num_crops", [0]))[0])
        if crops:
            seq = (
                f"Here is the original image {seq} and here are some crops to help you see "
                "better " + " ".join([seq] * crops)
            )
        return np.asarray(encoded["pixel_values"], dtype=np.float32), seq, None
