"""Conversations with images through the model's own chat template and image processor.

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
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ray_disagg.models.base import IGNORE_INDEX

__all__ = ["ConversationProcessor", "read_records", "to_messages"]

IMAGE_PAD = "<|image_pad|>"
ASSISTANT_HEADER = "<|im_start|>assistant\n"
END_OF_TURN = "<|im_end|>"
LABEL_MODES = ("assistant", "last", "all")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a ``.json`` (a list), ``.jsonl`` or ``.parquet`` file."""
    path = os.fspath(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


def _llava_messages(record: dict, rid) -> tuple[list[dict], list[str]]:
    images = record.get("images", record.get("image")) or []
    images = [images] if isinstance(images, str) else list(images)
    messages, used = [], 0
    for turn in record["conversations"]:
        role = _ROLES.get(turn.get("from"))
        if role is None:
            raise ValueError(f"record {rid!r}: unknown role {turn.get('from')!r}")
        parts = []
        for k, piece in enumerate(turn["value"].split("<image>")):
            if k:
                parts.append({"type": "image"})
                used += 1
            if piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        messages.append({"role": role, "content": parts})
    if used != len(images):
        raise ValueError(f"record {rid!r}: {len(images)} images but {used} <image> tags")
    return messages, images


def to_messages(record: dict) -> tuple[list[dict], list[str]]:
    """``(messages, image paths in order)`` of a LLaVA or messages record; content is
    always a list of parts (``{"type": "text", "text"}``, ``{"type": "image"}``)."""
    rid = record.get("id")
    if "conversations" in record:
        return _llava_messages(record, rid)
    if "messages" not in record:
        raise ValueError(f"record {rid!r}: neither 'conversations' nor 'messages'")
    messages, images = [], []
    for m in record["messages"]:
        role = _ROLES.get(m.get("role"))
        if role is None:
            raise ValueError(f"record {rid!r}: unknown role {m.get('role')!r}")
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part.get("type") == "image":
                images.append(part.get("image") or part.get("path"))
                parts.append({"type": "image"})
            elif part.get("type") == "text":
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"record {rid!r}: unsupported content part {part!r}")
        messages.append({"role": role, "content": parts})
    return messages, images


def assistant_spans(text: str, mode: str = "assistant") -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the labelled text of a ChatML rendering."""
    if mode == "all":
        return [(0, len(text))]
    spans, at = [], 0
    while (head := text.find(ASSISTANT_HEADER, at)) >= 0:
        start = head + len(ASSISTANT_HEADER)
        end = text.find(END_OF_TURN, start)
        end = len(text) if end < 0 else end + len(END_OF_TURN)
        spans.append((start, end))
        at = end
    return spans[-1:] if mode == "last" else spans


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
    ):
        if labels not in LABEL_MODES:
            raise ValueError(f"labels={labels!r}: must be one of {LABEL_MODES}.")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("tokenizer: a fast tokenizer is needed (character offsets).")
        self.tokenizer, self.image_processor, self.config = tokenizer, image_processor, config
        self.media_root = None if media_root is None else os.fspath(media_root)
        self.labels, self.system_prompt = labels, system_prompt

    def _images(self, paths: list[str], rid) -> tuple[list[np.ndarray], list[np.ndarray]]:
        from PIL import Image

        pixels, grids = [], []
        for rel in paths:
            path = rel if self.media_root is None else os.path.join(self.media_root, rel)
            try:
                with Image.open(path) as im:
                    enc = self.image_processor(images=[im.convert("RGB")], return_tensors="np")
            except OSError as e:
                raise ValueError(f"record {rid!r}: cannot read image {path!r}: {e}") from e
            pixels.append(np.asarray(enc["pixel_values"], dtype=np.float32))
            grids.append(np.asarray(enc["image_grid_thw"], dtype=np.int64).reshape(-1, 3))
        return pixels, grids

    def render(self, messages: list[dict]) -> str:
        """The chat template's text (the system prompt first when set and missing)."""
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def __call__(self, record: dict) -> dict[str, Any]:
        rid = record.get("id")
        messages, paths = to_messages(record)
        text = self.render(messages)
        pixels, grids = self._images(paths, rid)
        merge = self.config.vision_config.spatial_merge_size
        pieces = text.split(IMAGE_PAD)
        if len(pieces) - 1 != len(grids):
            raise ValueError(
                f"record {rid!r}: the chat template made {len(pieces) - 1} image "
                f"placeholders for {len(grids)} images"
            )
        text = pieces[0]
        for grid, piece in zip(grids, pieces[1:]):
            text += IMAGE_PAD * (int(grid.prod()) // merge**2) + piece
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        spans = assistant_spans(text, self.labels)
        keep = np.zeros(len(ids), dtype=bool)
        for i, (s, e) in enumerate(enc["offset_mapping"]):
            keep[i] = any(a <= s and e <= b for a, b in spans)
        keep &= ids != self.config.image_token_id
        return {
            "id": rid,
            "input_ids": ids,
            "labels": np.where(keep, ids, IGNORE_INDEX),
            "pixel_values": np.concatenate(pixels) if pixels else None,
            "image_grid_thw": np.concatenate(grids) if grids else None,
        }
