"""Deprecated: ``load_llava`` is a thin wrapper over
:class:`ray_disagg.data.conversations.ConversationProcessor` (the tokenizer's chat template,
loss on the assistant turns), kept for one release. Stream records instead with
:func:`ray_disagg.data.stream.conversations_dataset`.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

__all__ = ["load_llava"]


def load_llava(
    annotations: str | os.PathLike,
    *,
    image_root: str | os.PathLike,
    tokenizer,
    image_processor,
    config,
    user_turn=None,
    assistant_turn=None,
):
    """The records of ``annotations`` (JSON, JSONL or parquet) converted at once by
    ``ConversationProcessor`` into a ``datasets.Dataset``. Deprecated: use
    ``conversations_dataset`` (streamed, resumable) or ``ConversationProcessor``.

    ``user_turn`` / ``assistant_turn`` (the old plain ``user:`` / ``assistant:`` prefixes)
    are gone: the tokenizer's chat template writes the turns, as at inference.

    Example:
        >>> ds = load_llava("train.jsonl", image_root="images", tokenizer=tok,  # doctest: +SKIP
        ...                 image_processor=proc, config=model_config)
    """
    import datasets

    from ray_disagg.data.conversations import ConversationProcessor, read_records

    warnings.warn(
        "load_llava is deprecated: use ray_disagg.data.stream.conversations_dataset "
        "(streamed, resumable) or ConversationProcessor; it will be removed.",
        DeprecationWarning,
        stacklevel=2,
    )
    if user_turn is not None or assistant_turn is not None:
        raise ValueError(
            "load_llava(user_turn=..., assistant_turn=...) is gone: turns are written by "
            "the tokenizer's chat template (tokenizer.chat_template), as at inference."
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "load_llava: the tokenizer has no chat template; load it from the model's "
            "directory (tokenizer_config.json / chat_template.jinja) or set "
            "tokenizer.chat_template."
        )
    convert = ConversationProcessor(
        tokenizer=tokenizer, image_processor=image_processor, config=config, media_root=image_root
    )
    samples = [convert(r) for r in read_records(annotations)]
    keys = sorted({k for s in samples for k in s})
    return datasets.Dataset.from_dict({k: [_tolist(s.get(k)) for s in samples] for k in keys})


def _tolist(v):
    return v.tolist() if isinstance(v, np.ndarray) else v
