"""What a family says about turning a conversation into its sample, as its HF processor
does (:class:`ProcessingHooks`, a base of every adapter): the code in
:mod:`ray_disagg.data` asks these hooks and names no family.

Two shapes of family:

- media expanded in the token ids (:attr:`ProcessingHooks.tiled_media` false; the Qwen
  families): the rendered chat template has one placeholder token per image, video or
  audio; each item is read (images and audio by :mod:`ray_disagg.data`, videos by
  :meth:`~ProcessingHooks.video_item`) and its placeholder becomes
  :meth:`~ProcessingHooks.media_ids`; :meth:`~ProcessingHooks.media_fields` makes the
  sample's media fields.
- media expanded in the text (``tiled_media`` true; Gemma 3, InternVL, LLaVA-OneVision):
  each :meth:`~ProcessingHooks.media_mark` of the rendered text becomes the text of
  :meth:`~ProcessingHooks.tile_image` / :meth:`~ProcessingHooks.tile_video_text` before
  tokenizing; :meth:`~ProcessingHooks.tile_fields` makes the fields.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

__all__ = ["ProcessingHooks", "token_text"]


def token_text(tokenizer, token_id: int) -> str:
    """The text of token ``token_id``."""
    return tokenizer.convert_ids_to_tokens(int(token_id))


class ProcessingHooks:
    """The processing hooks of a family (the defaults: the behaviour shared by most
    families, or a ``NotImplementedError`` naming the family that has no such step)."""

    tiled_media: ClassVar[bool] = False
    """Whether media placeholders are expanded in the rendered text (tiles, see the module
    docstring) rather than in the token ids."""
    template_newline: ClassVar[bool] = False
    """Whether the chat template writes a newline after each image / video part itself
    (then a LLaVA record's newline right after a media tag is not kept)."""
    video_processor_hint: ClassVar[str | None] = None
    """Where a family whose videos need its own video processor gets it (named in the
    error of a video record without ``ConversationProcessor(video_processor=...)``);
    ``None``: its videos need none."""
    reads_video_processor: ClassVar[bool] = False
    """Whether recipes load the family's video processor (:meth:`load_video_processor`)."""

    def load_video_processor(self, directory: str) -> Any:
        """The family's video processor (or its settings) from a local ``directory``;
        ``None`` where it has none there."""
        return None

    def build_image_processor(self, pixels: int):
        """A PIL image processor of the family made from its config alone (no files),
        resizing every image to about ``pixels`` pixels (the synthetic examples)."""
        raise NotImplementedError(
            f"{self.model_type} has no image processor built from its config (its adapter's "
            "build_image_processor)."
        )

    def tiny_chat(self) -> tuple[str, dict[str, int], str]:
        """What a tiny local model directory of the family needs
        (:func:`~ray_disagg.data.tiny_model.save_tiny_model`): its chat template, its
        special tokens with the tiny config's ids, and the end-of-turn token."""
        raise NotImplementedError(
            f"{self.model_type} has no tiny chat template: save its tokenizer and "
            "processors yourself (save_pretrained) and point model.pretrained_path there."
        )

    # ---- media expanded in the token ids ----------------------------------------------

    def video_item(self, path: str, proc) -> tuple:
        """One video of ``path`` read for ``proc`` (the
        :class:`~ray_disagg.data.conversations.ConversationProcessor`: its processors,
        ``fps`` and ``max_frames``): ``(pixels, grid, ...)``."""
        raise NotImplementedError(f"{self.model_type} does not read videos this way")

    def media_ids(self, kind: str, item: tuple, token: int, tokenizer) -> list[int]:
        """The token ids one ``kind`` placeholder (``token``) becomes for ``item``."""
        raise NotImplementedError(f"{self.model_type} does not expand {kind} placeholders")

    def media_fields(self, items: dict[str, list]) -> dict[str, Any]:
        """The sample's media fields of the read items (per kind, in order)."""
        raise NotImplementedError(f"{self.model_type} has no media fields this way")

    # ---- media expanded in the text (tiles) -------------------------------------------

    def media_mark(self, tokenizer, kind: str) -> str:
        """The text the chat template writes for one ``kind`` (``"image"``, ``"video"``)."""
        token = self.config.video_token_id if kind == "video" else self.config.image_token_id
        return token_text(tokenizer, token)

    def tile_image(self, tokenizer, encoded: dict, alone: bool) -> tuple[np.ndarray, str, Any]:
        """``(tiles, the text replacing its mark, image size or None)`` of one image the
        image processor ``encoded``; ``alone``: the sample's only image."""
        raise NotImplementedError(f"{self.model_type} has no tiled images")

    def video_initial_shift(self, settings) -> bool | float:
        """Where frame sampling starts (see
        :func:`~ray_disagg.data.video.tile_frame_indices`) with the video ``settings``."""
        return False

    def tile_video_text(self, tokenizer, frames: np.ndarray) -> str:
        """The text replacing one video's mark, of its ``frames`` (tiles)."""
        raise NotImplementedError(f"{self.model_type} has no tiled videos")

    def tile_fields(self, items: dict[str, list], order: list[str]) -> dict[str, np.ndarray]:
        """The sample's media fields of the ``(tiles, text, size)`` items per kind;
        ``order``: the kinds in the order of their marks in the text."""
        raise NotImplementedError(f"{self.model_type} has no tiled media")
