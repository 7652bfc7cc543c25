"""Conversations with images and videos through the model's own chat template and image
processor.

Two record formats (JSON list, JSON Lines or parquet; media paths relative to
``media_root`` or absolute)::

    LLaVA:    {"id": "1", "image": "a.png",
               "conversations": [{"from": "human", "value": "<image>\\nWhat is it?"},
                                 {"from": "gpt", "value": "A seven."}]}
    messages: {"id": "2", "messages": [
                 {"role": "user", "content": [{"type": "image", "image": "a.png"},
                                              {"type": "text", "text": "What is it?"}]},
                 {"role": "assistant", "content": "A seven."}]}

The text is the tokenizer's own chat template (``apply_chat_template``); each image is
resized and patched by the family's image processor (``min_pixels`` / ``max_pixels``),
and its placeholder is expanded to one token per merged patch, as the family's processor
does. Labels (Qwen's ChatML templates have no ``{% generation %}`` markers): the tokens of
each assistant message's content and its ``<|im_end|>``, never the role header
``<|im_start|>assistant\\n`` or the newline after ``<|im_end|>``.

Videos (``<video>`` with ``"video"`` / ``"videos"``, or ``{"type": "video", "video": path}``)
are decoded with PyAV and cut into patches as the family's video processor does (its
adapter's ``video_item``; :mod:`ray_disagg.data.video`). Audio (``<audio>`` with
``"audio"`` / ``"audios"``, or ``{"type": "audio", "audio": path}``; a family with an
audio tower) is decoded with PyAV and turned into log-mel features by the family's
feature extractor (:mod:`ray_disagg.data.audio`). Each placeholder token becomes the
tokens of the adapter's ``media_ids`` and the media the fields of its ``media_fields``
(the hooks of :mod:`ray_disagg.models.processing`). Families whose media are expanded in
the text (``tiled_media``: Gemma 3, InternVL, LLaVA-OneVision):
:mod:`ray_disagg.data.tiles`; a family without a video input refuses video records.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from ray_disagg.data.records import MEDIA, read_records, to_messages
from ray_disagg.data.tiles import tile_sample
from ray_disagg.models.base import IGNORE_INDEX

__all__ = ["ConversationProcessor", "read_records", "to_messages"]

logger = logging.getLogger(__name__)

LABEL_MODES = ("assistant", "last", "all")


def image_patches(path: str, image_processor) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values float32, image_grid_thw [1, 3] int64)`` of the image file at
    ``path`` (RGB) through ``image_processor``."""
    from PIL import Image

    with Image.open(path) as im:
        enc = image_processor(images=[im.convert("RGB")], return_tensors="np")
    grid = np.asarray(enc["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
    return np.asarray(enc["pixel_values"], dtype=np.float32), grid


class ConversationProcessor:
    """Turns one record into a sample of the family (``input_ids``, ``labels``,
    ``pixel_values``, ``image_grid_thw``).

    Args:
        tokenizer: a fast tokenizer with the model's chat template.
        image_processor: the family's image processor (e.g. ``Qwen2VLImageProcessorPil``).
        config: the model's config (token ids, ``spatial_merge_size``).
        media_root: the directory relative media paths start from.
        labels: ``"assistant"`` (every assistant turn), ``"last"`` (the last one) or
            ``"all"`` (every token but the media placeholders).
        system_prompt: a system message put first when a record has none.
        fps, max_frames: video frames sampled per second of video, and at most this many
            (each frame's pixels within the image processor's ``min_pixels`` /
            ``max_pixels``); decoded with PyAV (extra ``video``).
        feature_extractor: the family's audio feature extractor (Qwen2.5-Omni: its
            ``WhisperFeatureExtractor``), for audio parts (:mod:`ray_disagg.data.audio`).
        video_processor: the family's video processor where its videos need one (the
            adapter's ``video_processor_hint``; Qwen3-VL, Qwen3-VL-MoE, Qwen3.5: their
            ``Qwen3VLVideoProcessor``,
            settings only: frame sampling, the clip's pixel budget, normalization);
            InternVL, LLaVA-OneVision: the video processor or its settings as a mapping
            (e.g. its ``video_preprocessor_config.json``; InternVL's class needs
            torchvision), by default the image processor's; the Qwen2 families cut video
            frames with ``image_processor``.

    Example:
        >>> proc = ConversationProcessor(tokenizer=tok, image_processor=ip,  # doctest: +SKIP
        ...                              config=cfg, media_root="images")
        >>> sample = proc(read_records("train.jsonl")[0])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        tokenizer,
        image_processor,
        config,
        media_root: str | os.PathLike | None = None,
        labels: str = "assistant",
        system_prompt: str | None = None,
        fps: float = 2.0,
        max_frames: int | None = None,
        feature_extractor=None,
        video_processor=None,
    ):
        if labels not in LABEL_MODES:
            raise ValueError(f"labels={labels!r}: must be one of {LABEL_MODES}.")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("tokenizer: a fast tokenizer is needed (character offsets).")
        from ray_disagg.models import get_adapter

        self.tokenizer, self.image_processor, self.config = tokenizer, image_processor, config
        self.adapter = get_adapter(config)  # the family's hooks (a ValueError if unsupported)
        self.media_root = None if media_root is None else os.fspath(media_root)
        self.labels, self.system_prompt = labels, system_prompt
        self.fps, self.max_frames = fps, max_frames
        self.feature_extractor = feature_extractor
        self.video_processor = video_processor

    def media_path(self, rel: str) -> str:
        """Where the media file ``rel`` of a record is (under ``media_root`` if set)."""
        return rel if self.media_root is None else os.path.join(self.media_root, rel)

    def _media(self, media: list[tuple[str, str]], rid) -> dict[str, list]:
        """Per kind, the processed items in order: ``(pixels, grid[, seconds per grid])``."""
        out = {kind: [] for kind in MEDIA}
        for kind, rel in media:
            path = self.media_path(rel)
            try:
                if kind == "image":
                    out[kind].append(image_patches(path, self.image_processor))
                elif kind == "video":
                    out[kind].append(self.adapter.video_item(path, self))
                else:
                    from ray_disagg.data.audio import audio_features

                    out[kind].append(audio_features(path, self.feature_extractor))
            except (OSError, ValueError) as e:
                raise ValueError(f"record {rid!r}: cannot read {kind} {path!r}: {e}") from e
        return out

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The chat template's text (the system prompt first when set and missing) and
        the character spans ``[start, end)`` to label, found from the conversation's
        structure: assistant turn ``k`` spans from the end of the template's rendering of
        turns ``< k`` with the generation prompt (its role header) to the end of its
        rendering of turns ``<= k``, less the newlines after the end-of-turn token."""
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]

        def text(upto: int, prompt: bool = False) -> str:
            return self.tokenizer.apply_chat_template(
                messages[:upto], tokenize=False, add_generation_prompt=prompt
            )

        full = text(len(messages))
        if self.labels == "all":
            return full, [(0, len(full))]
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        spans = []
        for k in turns[-1:] if self.labels == "last" else turns:
            head, upto = text(k, prompt=True), text(k + 1)
            if not (upto.startswith(head) and full.startswith(upto)):
                raise ValueError(
                    "the chat template does not render this conversation turn by turn (it "
                    "rewrites earlier turns, e.g. drops their <think> blocks), so its earlier "
                    "assistant tokens cannot be told apart: use labels='last', or one record "
                    "per assistant turn"
                )
            spans.append((len(head), len(upto.rstrip("\n"))))
        return full, spans

    def _check(self, media: list[tuple[str, str]], rid) -> None:
        kinds, adapter = {kind for kind, _ in media}, self.adapter
        model_type = self.config.model_type
        if "video" in kinds and "videos" not in adapter.media:
            raise ValueError(
                f"record {rid!r} has a video but {model_type} {adapter.video_field_refusal}"
            )
        hint = adapter.video_processor_hint
        if "video" in kinds and hint is not None and self.video_processor is None:
            raise ValueError(
                f"record {rid!r}: {model_type} videos need "
                f"ConversationProcessor(video_processor=...), the family's ({hint}; only its "
                "settings are read)"
            )
        if "audio" in kinds and "audios" not in adapter.media:
            raise ValueError(
                f"record {rid!r}: audio needs a family with an audio tower, not {model_type!r}"
            )
        if "audio" in kinds and self.feature_extractor is None:
            raise ValueError(
                f"record {rid!r}: audio needs ConversationProcessor(feature_extractor=...), "
                "the family's (e.g. WhisperFeatureExtractor.from_pretrained(model_dir))"
            )

    def __call__(self, record: dict) -> dict[str, Any]:
        rid = record.get("id")
        messages, media = to_messages(record, self.config.model_type)
        if self.labels != "all" and not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"record {rid!r}: no assistant turn to take a loss on")
        return self.encode_variants(rid, [messages], media)[0]

    def encode_variants(self, rid, variants: list[list[dict]], media) -> list[dict[str, Any]]:
        """One sample per conversation of ``variants`` (e.g. a prompt with each of two
        answers) that share the media ``media`` (``[(kind, path)]``, processed once; the
        tiled families' per variant): ``id``, ``input_ids``, ``labels`` and the media
        fields (the same arrays in every sample)."""
        self._check(media, rid)
        if self.adapter.tiled_media:  # text-level expansion
            return [tile_sample(self, {"id": rid}, m, media) for m in variants]
        done = self._media(media, rid)
        fields = self.adapter.media_fields(done)
        return [{"id": rid, **self._tokens(m, done, rid), **fields} for m in variants]

    def encode_prompt(self, rid, messages: list[dict], media) -> dict[str, Any]:
        """A prompt for the model to complete (GRPO): ``id``, ``input_ids`` (the chat
        template with the generation prompt, the system prompt first when set) and the
        media fields; nothing is labelled."""
        self._check(media, rid)
        if self.adapter.tiled_media:
            raise ValueError(
                f"record {rid!r}: prompts of the tiled {self.config.model_type} family are not "
                "processed yet (it does not generate yet either)"
            )
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a template error names the record
            raise ValueError(f"record {rid!r}: {e}") from e
        ids = np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)
        done = self._media(media, rid)
        ids, _ = self._expand(ids, np.zeros(len(ids), dtype=bool), done, rid)
        return {"id": rid, "input_ids": ids, **self.adapter.media_fields(done)}

    def _tokens(self, messages: list[dict], done: dict, rid) -> dict[str, np.ndarray]:
        try:
            text, spans = self.render(messages)
        except Exception as e:  # a template error names the record
            raise ValueError(f"record {rid!r}: {e}") from e
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        # a token is labelled when it starts inside a span
        keep = np.asarray([any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]])
        ids, keep = self._expand(ids, keep, done, rid)
        return {"input_ids": ids, "labels": np.where(keep, ids, IGNORE_INDEX)}

    def _expand(self, ids: np.ndarray, keep: np.ndarray, done: dict, rid):
        """Each media placeholder token replaced by its item's tokens (never labels)."""
        spliced = {}
        for kind in MEDIA:
            token = getattr(self.config, f"{kind}_token_id", None)
            where = np.flatnonzero(ids == token) if token is not None else []
            if len(where) != len(done[kind]):
                raise ValueError(
                    f"record {rid!r}: the chat template made {len(where)} {kind} "
                    f"placeholders for {len(done[kind])} {kind}s"
                )
            for pos, item in zip(where, done[kind]):
                spliced[int(pos)] = self.adapter.media_ids(kind, item, token, self.tokenizer)
        out_ids, out_keep, last = [], [], 0
        for pos in sorted(spliced):
            out_ids += [ids[last:pos], np.asarray(spliced[pos], dtype=np.int64)]
            out_keep += [keep[last:pos], np.zeros(len(spliced[pos]), dtype=bool)]
            last = pos + 1
        out_ids.append(ids[last:])
        out_keep.append(keep[last:])
        return np.concatenate(out_ids), np.concatenate(out_keep)
