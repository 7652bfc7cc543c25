"""LLaVA-OneVision's video path, as HF's ``get_video_features`` computes it: every frame a
tile through the tower and projector, then pooled (HF's own ``apply_pooling``: bilinear to
``ceil(side / 2)`` squared rows), the frames' rows in order and one ``image_newline`` row
per video; the rows scatter at the ``video_token_id`` placeholders (HF's
``mm_encoder_outputs["video"]``).

A sample carries ``pixel_values_videos`` ``(frames, C, S, S)`` (every video's frames in
order) with ``video_frames`` ``(videos,)``, or ``(videos, frames, C, S, S)`` as HF's
processor gives one sample's videos of equal length. Videos of different frame counts
mix freely in a microbatch: the frames are tiles of the vision part's one tower call
(:meth:`~ray_disagg.models.llava_onevision.adapter.LlavaOnevisionAdapter.encode`).
"""

from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

from ray_disagg.models.base import SampleError

__all__ = ["OnevisionVideos"]


class OnevisionVideos:
    """The video hooks of the LLaVA-OneVision adapter (mixed in before ``LlavaAdapter``;
    needs its ``config``, ``tile_shape`` and ``_side``)."""

    @property
    def video_token_id(self) -> int:
        return self.config.video_token_id

    def video_frames(self, sample: dict) -> list[int] | None:
        """Each video's frame count (``None``: no videos)."""
        given = sample.get("video_frames")
        if given is not None:
            return [int(f) for f in np.ravel(given)]
        pixels = sample.get("pixel_values_videos")
        shape = None if pixels is None else np.shape(pixels)
        if shape is not None and len(shape) == 5:
            return [int(shape[1])] * int(shape[0])
        return None

    def video_pixels(self, sample: dict) -> np.ndarray:
        """The sample's frames as ``(frames, C, S, S)`` (a view)."""
        return np.asarray(sample["pixel_values_videos"]).reshape(-1, *self.tile_shape)

    @cached_property
    def frame_rows(self) -> int:
        """Rows of one frame after HF's own ``apply_pooling`` (run on a stand-in)."""
        stand_in = torch.zeros(1, self._side**2, 1)
        pooled = LlavaOnevisionModel.apply_pooling(SimpleNamespace(config=self.config), stand_in)
        return int(pooled.shape[1])

    def video_rows(self, sample: dict) -> int:
        """Rows of the sample's videos: the pooled frames and one newline row each."""
        frames = self.video_frames(sample) or []
        return sum(frames) * self.frame_rows + len(frames)

    def synthetic_videos(self, grids, rng) -> tuple[dict, list[int]]:
        """Random frames for videos of grid ``(t, h, w)`` (``t`` frames each) and their
        placeholder tokens."""
        frames = np.asarray([int(g[0]) for g in grids], dtype=np.int64)
        fields = {"video_frames": frames}
        shape = (int(frames.sum()), *self.tile_shape)
        fields["pixel_values_videos"] = rng.standard_normal(shape).astype(np.float32)
        return fields, [self.video_token_id] * self.video_rows(fields)

    def validate_videos(self, sample: dict, ids: np.ndarray, name: str) -> None:
        """:class:`SampleError` naming the sample if its video fields and tokens disagree."""
        pixels, frames = sample.get("pixel_values_videos"), self.video_frames(sample)
        if pixels is None and frames is not None:
            raise SampleError(f"{name}: 'video_frames' without 'pixel_values_videos'.")
        if pixels is not None:
            if frames is None:
                raise SampleError(
                    f"{name}: a 4-D 'pixel_values_videos' needs 'video_frames' (each video's "
                    "frame count); or give (videos, frames, C, S, S)."
                )
            shape, tile = tuple(np.shape(pixels)), self.tile_shape
            whole = (len(frames), frames[0], *tile) if len(set(frames)) == 1 else None
            if shape not in ((sum(frames), *tile), whole):
                raise SampleError(
                    f"{name}: pixel_values_videos has shape {shape} but its video_frames "
                    f"{frames} need {(sum(frames), *tile)} (every video's frames in order, "
                    "each resized to one tile)."
                )
        n_tokens = int((ids == self.video_token_id).sum())
        n_rows = self.video_rows(sample)
        if n_tokens != n_rows:
            raise SampleError(
                f"{name}: {n_tokens} video tokens (id {self.video_token_id}) in input_ids but "
                f"its videos give {n_rows} embeddings ({self.frame_rows} per frame and one "
                "per video); expand each video placeholder as the LLaVA-OneVision processor "
                "does."
            )

    def video_embeds(self, inner, frames: torch.Tensor, videos: list[dict]) -> torch.Tensor:
        """``video_embeds`` of ``videos`` from their frames' projector rows ``frames``
        ``(frames, side**2, D)``: HF's own ``apply_pooling``, each video's frames in order
        and then ``image_newline``, as HF's ``get_video_features`` concatenates them."""
        pooled = inner.apply_pooling(frames)
        counts = [f for s in videos for f in self.video_frames(s)]
        newline = inner.image_newline[None]
        pieces = []
        for video in pooled.split(counts):
            pieces += [video.flatten(0, 1), newline]
        return torch.cat(pieces)

    def video_output(self, rows: torch.Tensor) -> BaseModelOutputWithPooling:
        """HF's ``mm_encoder_outputs["video"]`` for the received rows (it flattens the
        first two dimensions of ``pooler_output``)."""
        return BaseModelOutputWithPooling(pooler_output=rows[None])

    def reference_videos(self, samples) -> dict:
        """``pixel_values_videos`` ``(videos, frames, C, S, S)`` for HF's forward, which
        takes the videos of a batch as one tensor: ``ValueError`` where their frame counts
        differ."""
        videos = []
        for s in samples:
            if s.get("pixel_values_videos") is not None:
                frames = self.video_frames(s)
                videos += np.split(self.video_pixels(s), np.cumsum(frames)[:-1])
        if not videos:
            return {}
        counts = sorted({len(v) for v in videos})
        if len(counts) > 1:
            raise ValueError(
                f"llava_onevision: HF's forward takes a batch's videos as one (videos, frames, "
                f"C, S, S) tensor, but these videos have {counts} frames; give the reference "
                "batch videos of one frame count."
            )
        return {"pixel_values_videos": torch.from_numpy(np.stack(videos))}
