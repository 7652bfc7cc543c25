"""Prompts in TRL's format through the model's chat template and processors: one record
becomes one prompt for ``ray_disagg.GRPO`` to complete on the training groups.

A record (JSON list, JSON Lines or parquet; image paths relative to ``media_root`` or
absolute), as ``trl.GRPOTrainer`` takes a prompt-only one::

    {"id": "q1",
     "prompt": [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "Which digit?"}]}],
     "images": ["a.png"],
     "solution": "seven"}

``prompt`` is a list of messages (or a string: one user message, through the chat
template too, where TRL would take it as it is); its ``{"type": "image"}`` parts take
``images`` (or TRL's single ``image``) in order (a part may name its file itself,
``{"type": "image", "image": "a.png"}``; messages without image parts get the images
first in the first user message, as TRL does). The sample's ``input_ids`` are the chat
template's rendering with the generation prompt (the assistant's header), its media
expanded as the family's processor does; every column of the record (``prompt`` and
``images`` too) is kept for the reward functions, which TRL calls with them.

Example:
    >>> prompts = PromptProcessor(ConversationProcessor(  # doctest: +SKIP
    ...     tokenizer=tok, image_processor=ip, config=cfg, media_root="images"))
    >>> sample = prompts(read_records("prompts.jsonl")[0])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from ray_disagg.data.conversations import ConversationProcessor
from ray_disagg.data.records import to_messages

__all__ = ["PromptProcessor", "prompt_messages"]


def prompt_messages(record: dict, rid) -> list[dict]:
    """The record's ``prompt`` messages with each image part naming its file (from
    ``images``, or TRL's single ``image``, in order; where the messages have no image
    part, the images go first in the first user message, as TRL's
    ``prepare_multimodal_messages`` puts them); ``ValueError`` naming the record when
    they do not match."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    ok = isinstance(prompt, list) and prompt
    if not ok or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError(
            f"record {rid!r}: 'prompt' must be a non-empty list of messages ({{'role', "
            f"'content'}}) or a string (TRL's prompt format), got {prompt!r}"
        )
    images = record.get("images")
    if images is None and record.get("image") is not None:
        images = [record["image"]]
    images = [images] if isinstance(images, str) else list(images or [])
    if images and not any(_has_image(m) for m in prompt):
        prompt = _images_first(prompt, len(images), rid)
    out = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, list):
            content = [_media_part(p, images, rid) for p in content]
        out.append({**m, "content": content})
    if images:
        raise ValueError(
            f"record {rid!r}: {len(images)} of its images are left over: the prompt has "
            "fewer {'type': 'image'} parts than 'images'"
        )
    return out


def _has_image(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(p.get("type") == "image" for p in content)


def _images_first(prompt: list[dict], n: int, rid) -> list[dict]:
    """``prompt`` with ``n`` image parts before the first user message's content."""
    for k, m in enumerate(prompt):
        if m["role"] == "user":
            content = m["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            first = {**m, "content": [{"type": "image"} for _ in range(n)] + list(content)}
            return [*prompt[:k], first, *prompt[k + 1 :]]
    raise ValueError(f"record {rid!r}: images but no user message to show them in")


def _media_part(part: dict, images: list, rid) -> dict:
    if part.get("type") != "image" or part.get("image") is not None:
        return part
    if not images:
        raise ValueError(
            f"record {rid!r}: the prompt has more {{'type': 'image'}} parts than 'images'"
        )
    return {**part, "image": images.pop(0)}


class PromptProcessor:
    """Turns one TRL prompt record into a GRPO prompt sample: ``input_ids`` (with the
    generation prompt), the media fields and the record's other columns.

    Args:
        processor: the family's :class:`ConversationProcessor` (tokenizer, image / video
            / audio processors, ``media_root``, ``system_prompt``).
    """

    def __init__(self, processor: ConversationProcessor):
        self.processor = processor

    @property
    def config(self):
        """The model's config (what :class:`~ray_disagg.data.stream.ConversationStream`
        reads of a processor)."""
        return self.processor.config

    def __call__(self, record: dict) -> dict[str, Any]:
        rid = record.get("id")
        if record.get("completion") is not None or record.get("messages") is not None:
            raise ValueError(
                f"record {rid!r} holds an answer ('completion' or 'messages'); GRPO's "
                "prompts hold only the 'prompt' the model completes"
            )
        prompt = prompt_messages(record, rid)
        messages, media = to_messages({"id": rid, "messages": prompt}, self.config.model_type)
        if messages[-1]["role"] == "assistant":
            raise ValueError(f"record {rid!r}: the prompt ends with an assistant turn")
        sample = self.processor.encode_prompt(rid, messages, media)
        return {**record, **sample, "prompt": record["prompt"]}
