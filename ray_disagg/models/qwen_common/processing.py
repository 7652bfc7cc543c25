"""The Qwen families' conversations (:class:`~ray_disagg.models.processing.ProcessingHooks`,
media expanded in the token ids): one placeholder token per merged patch of an image or a
video; a video's frames cut into patches with the image processor (``temporal_patch_size``
frames a group) and its seconds per group in the field the family's rope reads
(:attr:`~ray_disagg.models.qwen_common.adapter.QwenVLAdapter.llm_extra_fields`)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CHAT_TEMPLATE", "QwenProcessing"]

# Qwen2-VL's chat template (ChatML; as its chat_template.json ships it).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class QwenProcessing:
    """Processing hooks of the Qwen VL families (a mixin of their adapter)."""

    def build_image_processor(self, pixels: int):
        """``Qwen2VLImageProcessorPil`` with the tower's patch, temporal patch and merge
        sizes, every image resized to ``pixels`` pixels, rescaled and normalized."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        v = self.config.vision_config
        return Qwen2VLImageProcessorPil(
            patch_size=v.patch_size,
            temporal_patch_size=v.temporal_patch_size,
            merge_size=v.spatial_merge_size,
            min_pixels=pixels,
            max_pixels=pixels,
            do_rescale=True,
            do_normalize=True,
        )

    def tiny_chat(self):
        """Qwen2-VL's ChatML template (the later Qwen VL families' tiny models take it too:
        their images render the same way); its vision tokens at the config's ids, the
        turn markers after them."""
        c = self.config
        marks = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        ids = (c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id)
        special = dict(zip(marks, ids))
        last = max(ids)
        special.update({"<|im_start|>": last + 1, "<|im_end|>": last + 2})
        return CHAT_TEMPLATE, special, "<|im_end|>"

    def video_item(self, path, proc) -> tuple:
        """``(pixels, grid, seconds per temporal group)``: frames decoded at ``proc.fps``
        (a multiple of ``temporal_patch_size``), patched by the image processor."""
        from ray_disagg.data.video import decode_video, video_patches

        t = proc.image_processor.temporal_patch_size
        frames, fps = decode_video(path, fps=proc.fps, max_frames=proc.max_frames, multiple=t)
        pixels, grid = video_patches(frames, proc.image_processor)
        return pixels, grid, t / fps

    def media_ids(self, kind, item, token, tokenizer) -> list[int]:
        """One ``token`` per merged patch of the item's grid."""
        merge = self.config.vision_config.spatial_merge_size
        return [token] * (int(item[1].prod()) // merge**2)

    def media_fields(self, items: dict[str, list]) -> dict[str, Any]:
        """``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` /
        ``video_grid_thw`` (``None`` for a kind the sample has none of), and each video's
        seconds per group in the family's rope field."""
        out = {}
        for kind, (pixels, grid) in (
            ("image", ("pixel_values", "image_grid_thw")),
            ("video", ("pixel_values_videos", "video_grid_thw")),
        ):
            done = items[kind]
            out[pixels] = np.concatenate([i[0] for i in done]) if done else None
            out[grid] = np.concatenate([i[1] for i in done]) if done else None
        if items["video"]:
            for field in self.llm_extra_fields:
                out[field] = np.asarray([v[2] for v in items["video"]], np.float32)
        return out
