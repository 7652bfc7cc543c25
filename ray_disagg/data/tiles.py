"""Conversations for the LLaVA-shaped families (Gemma 3, InternVL, LLaVA-OneVision), on
the CPU route of the Qwen families: the tokenizer's chat template, the family's PIL image
processor (no torchvision), and each image placeholder of the rendered text replaced by
the text the family's processor puts there, before tokenizing (so the tokens are the
processor's):

- Gemma 3: ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>" + <image>*n +
  "<end_of_image>\\n\\n"``; with pan-and-scan, the original image's sequence and one per
  crop in the processor's sentence. One tile per image and crop.
- InternVL: the context token becomes ``<img>`` + context tokens for every tile +
  ``</img>``.
- LLaVA-OneVision: ``<image>`` is repeated once per row the model makes of the image
  (crops alone in their sample, one base tile when the sample has several images).

Videos (InternVL, LLaVA-OneVision; Gemma 3 has no video input) are decoded with PyAV and
their frames sampled and made tiles as the family's video processor does
(:func:`~ray_disagg.data.video.tile_frames`); the video placeholder becomes the text of
the family's processor (its own ``replace_video_token``):

- InternVL: ``<video>`` becomes one ``Frame{i}: <img>`` + context tokens + ``</img>`` run
  per frame, and each frame is a tile of ``pixel_values``, images' tiles and videos'
  frames in the order of their placeholders (the model has no video input).
- LLaVA-OneVision: ``<video>`` is repeated once per row the model makes of the video
  (the pooled rows of every frame and one ``image_newline`` row); the frames go to
  ``pixel_values_videos`` ``(frames, C, S, S)`` with each video's frame count in
  ``video_frames``.

Label spans (found on the rendered text) move with the replacements; replaced text is
never labelled.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["TILE_FAMILIES", "tile_sample"]

TILE_FAMILIES = ("gemma3", "internvl", "llava_onevision")


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.convert_ids_to_tokens(int(token_id))


def placeholder(config, tokenizer, kind: str = "image") -> str:
    """The text the chat template writes for one image (``kind="video"``: one video)."""
    if kind == "video":
        if config.model_type == "internvl":
            return getattr(tokenizer, "video_token", None) or "<video>"
        return _token(tokenizer, config.video_token_id)
    if config.model_type == "gemma3":
        return _token(tokenizer, config.boi_token_id)
    return _token(tokenizer, config.image_token_id)


def _image_marks(tokenizer) -> tuple[str, str]:
    """InternVL's begin / end of an image (or a frame)."""
    start = getattr(tokenizer, "start_image_token", None) or "<img>"
    return start, getattr(tokenizer, "end_image_token", None) or "</img>"


def _encode(path: str, image_processor) -> dict[str, np.ndarray]:
    from PIL import Image

    with Image.open(path) as im:
        return dict(image_processor(images=[im.convert("RGB")], return_tensors="np"))


def _image(adapter, tokenizer, enc: dict, alone: bool) -> tuple[np.ndarray, str, Any]:
    """``(tiles, replacement text, image size or None)`` of one processed image."""
    c = adapter.config
    image = _token(tokenizer, c.image_token_id)
    pixels = np.asarray(enc["pixel_values"], dtype=np.float32)
    if c.model_type == "gemma3":
        seq = f"\n\n{_token(tokenizer, c.boi_token_id)}{image * c.mm_tokens_per_image}"
        seq += f"{_token(tokenizer, c.eoi_token_id)}\n\n"
        crops = int(np.ravel(enc.get("num_crops", [0]))[0])
        if crops:
            seq = (
                f"Here is the original image {seq} and here are some crops to help you see "
                "better " + " ".join([seq] * crops)
            )
        return pixels, seq, None
    if c.model_type == "internvl":
        start, end = _image_marks(tokenizer)
        return pixels, f"{start}{image * (c.image_seq_length * len(pixels))}{end}", None
    size = tuple(int(x) for x in np.ravel(enc["image_sizes"])[:2])
    tiles = pixels.reshape(-1, *pixels.shape[-3:])[: adapter.image_tiles(size, alone)]
    return tiles, image * adapter.image_rows(size, alone), size


def _video(proc, adapter, path: str) -> tuple[np.ndarray, str, None]:
    """``(frames as tiles, replacement text, None)`` of one video: the frames of
    :func:`~ray_disagg.data.video.tile_frames` with the video processor's settings (the
    image processor's where none is given), the text of the family processor's own
    ``replace_video_token``."""
    from ray_disagg.data.video import tile_frames, video_setting

    c, tok = adapter.config, proc.tokenizer
    settings = proc.video_processor if proc.video_processor is not None else proc.image_processor
    internvl = c.model_type == "internvl"
    shift = video_setting(settings, "initial_shift", True) if internvl else False
    frames = tile_frames(
        path, settings, fps=proc.fps, max_frames=proc.max_frames, initial_shift=shift
    )
    inputs = {"pixel_values_videos": [frames]}
    if internvl:
        from transformers.models.internvl.processing_internvl import InternVLProcessor

        start, end = _image_marks(tok)
        me = SimpleNamespace(
            start_image_token=start,
            end_image_token=end,
            image_token=_token(tok, c.image_token_id),
            image_seq_length=c.image_seq_length,
        )
        return frames, InternVLProcessor.replace_video_token(me, inputs, 0), None
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    v = c.vision_config
    me = SimpleNamespace(
        num_image_tokens=(v.image_size // v.patch_size) ** 2,
        video_token=_token(tok, c.video_token_id),
    )
    return frames, LlavaOnevisionProcessor.replace_video_token(me, inputs, 0), None


def _expand(text: str, spans, marks: dict, replacements: dict, rid):
    """``text`` with each kind's ``marks[kind]`` occurrences replaced in order by
    ``replacements[kind]``, the label spans moved, the replaced ranges (never labelled)
    and the kinds in the order of their placeholders in the text."""
    for kind, mark in marks.items():
        found, want = text.count(mark), len(replacements[kind])
        if found != want:
            raise ValueError(
                f"record {rid!r}: the chat template made {found} {kind} placeholders "
                f"({mark!r}) for {want} {kind}s"
            )
    kind_of = {mark: kind for kind, mark in marks.items()}
    todo = {kind: iter(reps) for kind, reps in replacements.items()}
    out, moved, ranges, order, pos, length = [], [], [], [], 0, 0
    for match in re.finditer("|".join(map(re.escape, kind_of)), text):
        at, kind = match.start(), kind_of[match.group()]
        rep = next(todo[kind])
        out.append(text[pos:at])
        length += at - pos
        ranges.append((length, length + len(rep)))
        out.append(rep)
        length += len(rep)
        moved.append((at, len(rep) - len(match.group())))
        order.append(kind)
        pos = match.end()
    out.append(text[pos:])

    def shift(x: int) -> int:
        return x + sum(d for at, d in moved if at < x)

    return "".join(out), [(shift(a), shift(b)) for a, b in spans], ranges, order


def _media_items(proc, adapter, media: list, rid) -> dict[str, list]:
    """Per kind, ``(pixels, replacement text, image size)`` of each item in order."""
    n_images = sum(kind == "image" for kind, _ in media)
    items = {"image": [], "video": []}
    for kind, rel in media:
        path = proc.media_path(rel)
        try:
            if kind == "image":
                enc = _encode(path, proc.image_processor)
                items[kind].append(_image(adapter, proc.tokenizer, enc, alone=n_images == 1))
            else:
                items[kind].append(_video(proc, adapter, path))
        except (OSError, ValueError) as e:
            raise ValueError(f"record {rid!r}: cannot read {kind} {path!r}: {e}") from e
    return items


def _fields(model_type: str, items: dict, order: list[str]) -> dict[str, np.ndarray]:
    """The sample's media fields (InternVL: frames are tiles, in placeholder order)."""
    images, videos = items["image"], items["video"]
    if model_type == "internvl":
        todo = {kind: iter(v) for kind, v in items.items()}
        tiles = [next(todo[kind])[0] for kind in order]
        return {"pixel_values": np.concatenate(tiles)} if tiles else {}
    out = {}
    if images:
        out["pixel_values"] = np.concatenate([i[0] for i in images])
        if model_type == "llava_onevision":
            out["image_sizes"] = np.asarray([i[2] for i in images], dtype=np.int64)
    if videos:
        out["pixel_values_videos"] = np.concatenate([v[0] for v in videos])
        out["video_frames"] = np.asarray([len(v[0]) for v in videos], dtype=np.int64)
    return out


def tile_sample(proc, record: dict, messages: list[dict], media: list) -> dict[str, Any]:
    """The sample of ``record`` for a LLaVA-shaped family (``proc``: the
    :class:`~ray_disagg.data.conversations.ConversationProcessor`)."""
    from ray_disagg.models import get_adapter
    from ray_disagg.models.base import IGNORE_INDEX

    rid, adapter, tok = record.get("id"), get_adapter(proc.config), proc.tokenizer
    items = _media_items(proc, adapter, media, rid)
    try:
        text, spans = proc.render(messages)
    except Exception as e:  # a template error names the record
        raise ValueError(f"record {rid!r}: {e}") from e
    kinds = ("image", "video") if "videos" in adapter.media else ("image",)
    marks = {kind: placeholder(proc.config, tok, kind) for kind in kinds}
    reps = {kind: [i[1] for i in items[kind]] for kind in kinds}
    text, spans, ranges, order = _expand(text, spans, marks, reps, rid)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = [s for s, _ in enc["offset_mapping"]]
    keep = np.asarray(
        [
            any(a <= s < b for a, b in spans) and not any(a <= s < b for a, b in ranges)
            for s in starts
        ],
        dtype=bool,
    )
    sample = {"id": rid, "input_ids": ids, "labels": np.where(keep, ids, IGNORE_INDEX)}
    return {**sample, **_fields(adapter.model_type, items, order)}
