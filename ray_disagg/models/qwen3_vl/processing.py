"""Qwen3-VL's videos (and those of the families that share its processor: Qwen3-VL-MoE,
Qwen3.5): sampled, sized for the whole clip and normalized as its video processor does,
and written with a timestamp and a run of their own per group of frames, as
``Qwen3VLProcessor`` writes them."""

from __future__ import annotations

import os

import numpy as np

from ray_disagg.models.qwen_common.processing import QwenProcessing

__all__ = ["Qwen3VLProcessing", "qwen3_video"]


def qwen3_video(
    path: str | os.PathLike, video_processor, *, fps: float | None = None, max_frames=None
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """``(pixel_values_videos, video_grid_thw [1, 3], seconds of each frame group)`` of
    the video at ``path`` as Qwen3-VL's video processor makes them, with its settings
    (``video_processor``: a ``Qwen3VLVideoProcessor``, only read): frames sampled at
    ``fps`` (default its own) between its ``min_frames`` and ``max_frames``, every frame
    resized to one size chosen for the whole clip (its ``smart_resize`` over frames x
    pixels), rescaled and normalized, grouped by ``temporal_patch_size``."""
    from transformers.image_utils import PILImageResampling
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from ray_disagg.data.video import decode_frames, group_timestamps, patchify, transform_frames

    vp = video_processor
    fps = vp.fps if fps is None else fps
    most = vp.max_frames if max_frames is None else min(max_frames, vp.max_frames)

    def pick(total: int, rate: float) -> np.ndarray:
        n = min(max(int(total / rate * fps), vp.min_frames), most, total)
        return np.linspace(0, total - 1, n).round().astype(int)

    frames, keep, rate, _ = decode_frames(path, pick)
    p, m, t = vp.patch_size, vp.merge_size, vp.temporal_patch_size
    size, n = vp.size, len(frames)
    max_pixels = size["longest_edge"]
    if vp.cap_pixels_per_frame:  # the processor's per-frame cap
        cap = vp.max_video_tokens * (p * m) ** 2
        per_frame = max(min(cap, max_pixels // n), int(size["shortest_edge"] * 1.05))
        max_pixels = per_frame * n
    h, w = smart_resize(
        n, frames.shape[1], frames.shape[2], t, p * m, size["shortest_edge"], max_pixels
    )
    scaled = transform_frames(
        frames, (h, w), PILImageResampling(vp.resample), vp.rescale_factor,
        (vp.image_mean, vp.image_std),
    )  # fmt: skip
    pixels, grid = patchify(scaled, p, m, t)
    return pixels, grid, group_timestamps(keep, rate, t)


class Qwen3VLProcessing(QwenProcessing):
    """Processing hooks of Qwen3-VL: its video processor's frames and timestamps."""

    video_processor_hint = "Qwen3VLVideoProcessor.from_pretrained(model_dir)"
    reads_video_processor = True

    def load_video_processor(self, directory):
        """``Qwen3VLVideoProcessor`` (only its settings are read: no torchvision)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor,
        )

        return Qwen3VLVideoProcessor.from_pretrained(directory, local_files_only=True)

    def video_item(self, path, proc) -> tuple:
        """``(pixels, grid, each group's timestamp)`` (:func:`qwen3_video`)."""
        return qwen3_video(path, proc.video_processor, fps=proc.fps, max_frames=proc.max_frames)

    def media_ids(self, kind, item, token, tokenizer) -> list[int]:
        """A video: per frame group ``<t seconds>`` and its own vision start, pads, end."""
        if kind != "video":
            return super().media_ids(kind, item, token, tokenizer)
        _, grid, times = item
        c, merge = self.config, self.config.vision_config.spatial_merge_size
        per_group, out = int(grid[0, 1:].prod()) // merge**2, []
        for t in times:
            out += tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False)["input_ids"]
            out += [c.vision_start_token_id, *[token] * per_group, c.vision_end_token_id]
        return out
