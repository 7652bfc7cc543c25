"""Conversation records (LLaVA and messages formats) read into chat messages and their
media, before the chat template: see :mod:`ray_disagg.data.conversations`."""

from __future__ import annotations

import json
import os
import re

__all__ = ["MEDIA", "read_records", "to_messages"]

MEDIA = ("image", "video", "audio")
_TAG = re.compile(r"(<image>|<video>|<audio>)")
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


def _paths(record: dict, key: str) -> list[str]:
    value = record.get(f"{key}s", record.get(key)) or []
    return [value] if isinstance(value, str) else list(value)


def _template_newline(model_type: str | None) -> bool:
    """Whether the family's chat template writes a newline after each media part itself
    (its adapter's ``template_newline``)."""
    from ray_disagg.models import ADAPTERS

    return model_type in ADAPTERS and ADAPTERS[model_type].template_newline


def _turn_parts(text: str, files: dict, used: dict, media: list, rid, newline: bool) -> list:
    """The content parts of one LLaVA turn: each tag a media part, the text between tags
    as written (whitespace included), except the newline right after a tag when the
    family's template writes that newline itself (``newline``)."""
    parts, after_tag = [], False
    for piece in _TAG.split(text):
        kind = piece[1:-1] if _TAG.fullmatch(piece) else None
        if kind is not None:
            if used[kind] >= len(files[kind]):
                raise ValueError(f"record {rid!r}: more <{kind}> tags than {kind}s")
            media.append((kind, files[kind][used[kind]]))
            used[kind] += 1
            parts.append({"type": kind})
        else:
            if after_tag and newline and piece.startswith("\n"):
                piece = piece[1:]
            if piece:
                parts.append({"type": "text", "text": piece})
        after_tag = kind is not None
    return parts


def _turns(record: dict, rid, model_type) -> tuple[list[dict], list[tuple[str, str]]]:
    """The messages and media of a LLaVA record."""
    files, newline = {kind: _paths(record, kind) for kind in MEDIA}, _template_newline(model_type)
    messages, media, used = [], [], {kind: 0 for kind in MEDIA}
    for turn in record["conversations"]:
        role = _ROLES.get(turn.get("from"))
        if role is None:
            raise ValueError(f"record {rid!r}: unknown role {turn.get('from')!r}")
        parts = _turn_parts(turn["value"], files, used, media, rid, newline)
        messages.append({"role": role, "content": parts})
    for kind in MEDIA:
        if used[kind] != len(files[kind]):
            n, k = len(files[kind]), used[kind]
            raise ValueError(f"record {rid!r}: {n} {kind}s but {k} <{kind}> tags")
    return messages, media


def to_messages(
    record: dict, model_type: str | None = None
) -> tuple[list[dict], list[tuple[str, str]]]:
    """``(messages, [(kind, path), ...] in order)`` of a LLaVA or messages record; content
    is always a list of parts (``{"type": "text", "text"}``, ``{"type": "image"}``,
    ``{"type": "video"}``, ``{"type": "audio"}``); ``kind`` is one of :data:`MEDIA`.

    A LLaVA turn's text is kept as written: each ``<image>`` / ``<video>`` / ``<audio>``
    tag becomes a media part where it stands and the text around it is untouched, as
    Qwen's own fine-tuning code replaces the tag in place. The one exception is the
    family's template (``model_type``, its adapter's ``template_newline``): InternVL's and
    LLaVA-OneVision's write a newline after each image themselves, so for them the
    newline right after a tag is not kept
    (``"<image>\\nWhat?"`` renders once as ``"<IMG_CONTEXT>\\nWhat?"``). Gemma 3's
    template trims each text part itself.

    Example:
        >>> record = {"image": "a.png", "conversations": [
        ...     {"from": "human", "value": "compare <image> and this"},
        ...     {"from": "gpt", "value": " Same."}]}
        >>> [part.get("text") for part in to_messages(record)[0][0]["content"]]
        ['compare ', None, ' and this']
    """
    rid = record.get("id")
    if "conversations" in record:
        return _turns(record, rid, model_type)
    if "messages" not in record:
        raise ValueError(f"record {rid!r}: neither 'conversations' nor 'messages'")
    messages, media = [], []
    for m in record["messages"]:
        role = _ROLES.get(m.get("role"))
        if role is None:
            raise ValueError(f"record {rid!r}: unknown role {m.get('role')!r}")
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in MEDIA:
                path = part.get(kind) or part.get("path")
                if not isinstance(path, str):
                    raise ValueError(f"record {rid!r}: a {kind} part without a path: {part!r}")
                media.append((kind, path))
                parts.append({"type": kind})
            elif kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"record {rid!r}: unsupported content part {part!r}")
        messages.append({"role": role, "content": parts})
    return messages, media
