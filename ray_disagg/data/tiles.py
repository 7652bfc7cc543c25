"""Conversations of the families whose media are expanded in the text (the adapter's
``tiled_media``: Gemma 3, InternVL, LLaVA-OneVision), on the CPU route of the others:
the tokenizer's chat template, the family's PIL image processor (no torchvision), and
each image or video mark of the rendered text (the adapter's ``media_mark``) replaced by
the text the family's processor puts there (``tile_image``, ``tile_video_text``) before
tokenizing, so the tokens are the processor's; the tiles become the sample's fields
(``tile_fields``). The hooks are in each family's ``processing.py``
(:mod:`ray_disagg.models.processing`).

Videos are decoded with PyAV and their frames sampled and made tiles as the family's
video processor does (:func:`~ray_disagg.data.video.tile_frames`, from the adapter's
``video_initial_shift``).

Label spans (found on the rendered text) move with the replacements; replaced text is
never labelled.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["tile_sample"]


def _encode(path: str, image_processor) -> dict[str, np.ndarray]:
    from PIL import Image

    with Image.open(path) as im:
        return dict(image_processor(images=[im.convert("RGB")], return_tensors="np"))


def _video(proc, adapter, path: str) -> tuple[np.ndarray, str, None]:
    """``(frames as tiles, replacement text, None)`` of one video: the frames of
    :func:`~ray_disagg.data.video.tile_frames` with the video processor's settings (the
    image processor's where none is given), the text of the family's
    ``tile_video_text``."""
    from ray_disagg.data.video import tile_frames

    settings = proc.video_processor if proc.video_processor is not None else proc.image_processor
    shift = adapter.video_initial_shift(settings)
    frames = tile_frames(
        path, settings, fps=proc.fps, max_frames=proc.max_frames, initial_shift=shift
    )
    return frames, adapter.tile_video_text(proc.tokenizer, frames), None


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
                items[kind].append(adapter.tile_image(proc.tokenizer, enc, alone=n_images == 1))
            else:
                items[kind].append(_video(proc, adapter, path))
        except (OSError, ValueError) as e:
            raise ValueError(f"record {rid!r}: cannot read {kind} {path!r}: {e}") from e
    return items


def tile_sample(proc, record: dict, messages: list[dict], media: list) -> dict[str, Any]:
    """The sample of ``record`` for a family with ``tiled_media`` (``proc``: the
    :class:`~ray_disagg.data.conversations.ConversationProcessor`)."""
    from ray_disagg.models.base import IGNORE_INDEX

    rid, adapter, tok = record.get("id"), proc.adapter, proc.tokenizer
    items = _media_items(proc, adapter, media, rid)
    try:
        text, spans = proc.render(messages)
    except Exception as e:  # a template error names the record
        raise ValueError(f"record {rid!r}: {e}") from e
    kinds = ("image", "video") if "videos" in adapter.media else ("image",)
    marks = {kind: adapter.media_mark(tok, kind) for kind in kinds}
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
    return {**sample, **adapter.tile_fields(items, order)}
