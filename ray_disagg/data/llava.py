"""Load LLaVA-style annotations into ray_disagg samples.

One record (a JSON list or JSON Lines file)::

    {"id": "0001", "image": "images/0001.png",
     "conversations": [{"from": "human", "value": "<image>\\nWhich digit is this?"},
                       {"from": "gpt", "value": "a seven"}]}

Images are patched by the Qwen2.5-VL image processor (its ``min_pixels``/``max_pixels``
decide the resize); ``<image>`` becomes ``<vision_start> <image_pad> * n <vision_end>`` with
``n`` the image's merged-token count; the loss is taken on the assistant turns only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["load_llava"]

IMAGE_PLACEHOLDER = "<image>"
_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "assistant"}


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _build(record: dict, *, image_root, tokenizer, image_processor, config, turn_format) -> dict:
    from ray_disagg.data.conversations import image_patches

    images = record.get("image")
    images = [] if images is None else [images] if isinstance(images, str) else list(images)
    pixel_values, grids = [], []
    for rel in images:
        pixels, grid = image_patches(os.path.join(image_root, rel), image_processor)
        pixel_values.append(pixels)
        grids.append(grid)
    merge = config.vision_config.spatial_merge_size
    n_tokens = [int(g.prod()) // merge**2 for g in grids]

    ids: list[int] = []
    labels: list[int] = []
    image_i = 0
    for turn in record["conversations"]:
        role = turn["from"]
        if role not in _USER_ROLES | _ASSISTANT_ROLES:
            raise ValueError(f"record {record.get('id')!r}: unknown role {role!r}")
        prefix, suffix = turn_format[role in _ASSISTANT_ROLES]
        pieces = turn["value"].split(IMAGE_PLACEHOLDER)
        body: list[int] = []
        for k, piece in enumerate(pieces):
            if k:
                if image_i >= len(n_tokens):
                    raise ValueError(f"record {record.get('id')!r}: more <image> than images")
                body += [config.vision_start_token_id]
                body += [config.image_token_id] * n_tokens[image_i]
                body += [config.vision_end_token_id]
                image_i += 1
            body += _encode(tokenizer, piece.strip())
        head, tail = _encode(tokenizer, prefix), _encode(tokenizer, suffix)
        ids += head + body + tail
        if role in _ASSISTANT_ROLES:
            labels += [-100] * len(head) + body + tail
        else:
            labels += [-100] * (len(head) + len(body) + len(tail))
    if image_i != len(n_tokens):
        raise ValueError(
            f"record {record.get('id')!r}: {len(n_tokens)} images but {image_i} <image> tags"
        )
    out: dict[str, Any] = {
        "id": record.get("id"),
        "input_ids": np.asarray(ids, dtype=np.int64),
        "labels": np.asarray(labels, dtype=np.int64),
    }
    if grids:
        out["pixel_values"] = np.concatenate(pixel_values).astype(np.float32)
        out["image_grid_thw"] = np.concatenate(grids).astype(np.int64)
    return out


def load_llava(
    annotations: str | os.PathLike,
    *,
    image_root: str | os.PathLike,
    tokenizer,
    image_processor,
    config,
    user_turn: tuple[str, str] = ("user:", ""),
    assistant_turn: tuple[str, str] = ("assistant:", ""),
):
    """Read ``annotations`` (JSON or JSONL) with ``datasets`` and return a
    ``datasets.Dataset`` of samples for :class:`~ray_disagg.DisaggregatedTrainer`.

    ``tokenizer`` is any Hugging Face tokenizer, ``image_processor`` a Qwen2-VL image
    processor (set its ``min_pixels``/``max_pixels``), ``config`` the model's
    ``Qwen2_5_VLConfig`` (image / vision start / end token ids, merge size).
    ``user_turn`` / ``assistant_turn`` are the ``(prefix, suffix)`` text around each turn.

    Example:
        >>> ds = load_llava("train.jsonl", image_root="images", tokenizer=tok,  # doctest: +SKIP
        ...                 image_processor=proc, config=model_config)
    """
    import datasets

    raw = datasets.Dataset.from_json(os.fspath(annotations))
    formats = {False: user_turn, True: assistant_turn}
    records = [
        _build(
            dict(r),
            image_root=os.fspath(image_root),
            tokenizer=tokenizer,
            image_processor=image_processor,
            config=config,
            turn_format=formats,
        )
        for r in raw
    ]
    keys = sorted({k for r in records for k in r})
    return datasets.Dataset.from_dict({k: [_tolist(r.get(k)) for r in records] for k in keys})


def _tolist(v):
    return v.tolist() if isinstance(v, np.ndarray) else v
