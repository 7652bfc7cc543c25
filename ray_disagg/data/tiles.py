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

Label spans (found on the rendered text) move with the replacements; replaced text is
never labelled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TILE_FAMILIES", "tile_sample"]

TILE_FAMILIES = ("gemma3", "internvl", "llava_onevision")


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.convert_ids_to_tokens(int(token_id))


def placeholder(config, tokenizer) -> str:
    """The text the chat template writes for one image."""
    if config.model_type == "gemma3":
        return _token(tokenizer, config.boi_token_id)
    return _token(tokenizer, config.image_token_id)


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
        start = getattr(tokenizer, "start_image_token", None) or "<img>"
        end = getattr(tokenizer, "end_image_token", None) or "</img>"
        return pixels, f"{start}{image * (c.image_seq_length * len(pixels))}{end}", None
    size = tuple(int(x) for x in np.ravel(enc["image_sizes"])[:2])
    tiles = pixels.reshape(-1, *pixels.shape[-3:])[: adapter.image_tiles(size, alone)]
    return tiles, image * adapter.image_rows(size, alone), size


def _expand(text: str, spans, mark: str, replacements: list[str], rid):
    """``text`` with the ``mark`` occurrences replaced in order, the label spans moved,
    and the replaced ranges (never labelled)."""
    found = text.count(mark)
    if found != len(replacements):
        raise ValueError(
            f"record {rid!r}: the chat template made {found} image placeholders "
            f"({mark!r}) for {len(replacements)} images"
        )
    out, moved, ranges, pos, length = [], [], [], 0, 0
    for rep in replacements:
        at = text.index(mark, pos)
        out.append(text[pos:at])
        length += at - pos
        ranges.append((length, length + len(rep)))
        out.append(rep)
        length += len(rep)
        moved.append((at, len(rep) - len(mark)))
        pos = at + len(mark)
    out.append(text[pos:])

    def shift(x: int) -> int:
        return x + sum(d for at, d in moved if at < x)

    return "".join(out), [(shift(a), shift(b)) for a, b in spans], ranges


def tile_sample(proc, record: dict, messages: list[dict], media: list) -> dict[str, Any]:
    """The sample of ``record`` for a LLaVA-shaped family (``proc``: the
    :class:`~ray_disagg.data.conversations.ConversationProcessor`)."""
    from ray_disagg.models import get_adapter
    from ray_disagg.models.base import IGNORE_INDEX

    rid, adapter, tok = record.get("id"), get_adapter(proc.config), proc.tokenizer
    images = []
    for _, rel in media:
        path = proc.media_path(rel)
        try:
            enc = _encode(path, proc.image_processor)
        except (OSError, ValueError) as e:
            raise ValueError(f"record {rid!r}: cannot read image {path!r}: {e}") from e
        images.append(_image(adapter, tok, enc, alone=len(media) == 1))
    try:
        text, spans = proc.render(messages)
    except Exception as e:  # a template error names the record
        raise ValueError(f"record {rid!r}: {e}") from e
    mark = placeholder(proc.config, tok)
    text, spans, ranges = _expand(text, spans, mark, [i[1] for i in images], rid)
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
    if images:
        sample["pixel_values"] = np.concatenate([i[0] for i in images])
        if adapter.model_type == "llava_onevision":
            sample["image_sizes"] = np.asarray([i[2] for i in images], dtype=np.int64)
    return sample
