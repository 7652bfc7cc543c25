"""Token statistics of a recipe's conversation records, from a sample of them, for
``ray-disagg plan``: what a sample costs the LLM (tokens, media tokens, label tokens) and
how many records would be dropped (broken, longer than ``max_seq_len``).

Example:
    >>> line = describe({"tokens": [10, 30], "media": [4, 0], "labels": [2, 3], "bad": 0,
    ...                  "long": 1, "sampled": 3, "records": 100})
    >>> line.split("; ")[0]
    '3 of 100 records: tokens/sample mean 20, p50 20, p95 29, max 30'
"""

from __future__ import annotations

import os
import pickle

import numpy as np

from ray_disagg.models.base import IGNORE_INDEX

__all__ = ["describe", "record_statistics", "recipe_statistics", "recipe_stream_statistics"]


def record_statistics(stream, n: int = 64, seed: int = 0) -> dict:
    """Convert ``n`` records of ``stream`` (a seeded sample, in this process) and count."""
    from ray_disagg.data.stream import BAD, LONG, RecordReader, epoch_order

    order = epoch_order(stream.num_records, seed, 0, shuffle=True)[:n]
    read, out = RecordReader(stream.index), {"tokens": [], "media": [], "labels": []}
    out.update(bad=0, long=0, sampled=len(order), records=stream.num_records)
    cfg = stream.processor.config
    kinds = ("image_token_id", "video_token_id", "audio_token_id")  # audio: Omni only
    pads = [getattr(cfg, k) for k in kinds if getattr(cfg, k, None) is not None]
    for i in order:
        outcome = stream.convert(int(i), read)
        if outcome["status"] in (BAD, LONG):
            out["bad" if outcome["status"] == BAD else "long"] += 1
            continue
        sample = pickle.loads(outcome["sample"])
        ids = np.asarray(sample["input_ids"])
        out["tokens"].append(len(ids))
        out["media"].append(int(np.isin(ids, pads).sum()))
        out["labels"].append(int((np.asarray(sample["labels"]) != IGNORE_INDEX).sum()))
    return out


def describe(stats: dict) -> str:
    head = f"{stats['sampled']} of {stats['records']} records: "
    tail = f"broken {stats['bad']}, over max_seq_len {stats['long']}"
    tokens = np.asarray(stats["tokens"])
    if not len(tokens):
        return head + "no sample converted; " + tail
    p50, p95 = np.percentile(tokens, [50, 95])
    share = 100 * sum(stats["media"]) / tokens.sum()
    return (
        head
        + f"tokens/sample mean {tokens.mean():.0f}, p50 {p50:.0f}, p95 {p95:.0f}, "
        + f"max {tokens.max()}; media tokens {share:.0f}%; label tokens/sample "
        + f"{np.mean(stats['labels']):.1f}; "
        + tail
    )


def recipe_stream_statistics(recipe, which: str = "train", n: int = 64) -> dict | None:
    """:func:`record_statistics` of ``recipe.data[which]`` when it is a stream of
    conversation records on this machine (``None`` otherwise)."""
    from ray_disagg.data.stream import ConversationStream
    from ray_disagg.recipes.data import build_dataset

    d = recipe.data[which]
    records = str(d.get("records", ""))
    if d["type"] != "conversations" or not os.path.exists(os.path.expanduser(records)):
        return None
    stream = build_dataset(recipe, which)
    return record_statistics(stream, n) if isinstance(stream, ConversationStream) else None


def recipe_statistics(recipe, which: str, n: int = 64) -> str | None:
    """``describe`` of ``recipe.data[which]`` when it is a stream of conversation records
    on this machine (``None`` otherwise: nothing to sample)."""
    stats = recipe_stream_statistics(recipe, which, n)
    return None if stats is None else describe(stats)
