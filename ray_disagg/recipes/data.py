"""The data sources of a recipe (``data.train`` / ``data.validation``): parsed without
loading anything (for ``plan``), loaded for ``train``.

- ``{type: digits, num_samples: N, start: 0, image_size: 16}``: scikit-learn's digits
  (:func:`ray_disagg.data.examples.digits_samples`), samples ``start .. start + N``;
- ``{type: llava, annotations: F, image_root: D, tokenizer, image_processor, min_pixels,
  max_pixels, user_turn, assistant_turn}``: :func:`ray_disagg.data.llava.load_llava`, tokenizer
  and image processor from local directories (default: ``model.pretrained_path``);
- ``{type: conversations, records: F, media_root: D, tokenizer, image_processor,
  min_pixels, max_pixels, labels, system_prompt, fps, max_frames, concurrency,
  max_seq_len, max_bad_records}``: LLaVA or messages records through the tokenizer's chat
  template and the family's image / video processing
  (:class:`ray_disagg.data.conversations.ConversationProcessor`; ``labels``: ``assistant``,
  ``last`` or ``all``), tokenizer and image processor from local directories (default:
  ``model.pretrained_path``). ``.jsonl`` / ``.parquet`` files or a directory of them are
  streamed (:class:`ray_disagg.data.stream.ConversationStream`, resumable); a ``.json``
  list is converted at once;
- ``{type: parquet | json, paths: P}``: a Ray Data dataset (``ray.data.read_<type>``).

Example:
    >>> parse_data({"type": "digits", "num_samples": 8}, "data.train")["start"]
    0
"""

from __future__ import annotations

import os

from ray_disagg.recipes.schema import REQUIRED, at, check, fail, section

__all__ = ["DATA", "build_dataset", "parse_data"]

DATA = {  # type -> keys (with defaults)
    "digits": {"num_samples": None, "start": 0, "image_size": 16},
    "llava": {
        "annotations": REQUIRED,
        "image_root": REQUIRED,
        "tokenizer": None,
        "image_processor": None,
        "min_pixels": None,
        "max_pixels": None,
        "user_turn": ["user:", ""],
        "assistant_turn": ["assistant:", ""],
    },
    "conversations": {
        "records": REQUIRED,
        "media_root": None,
        "tokenizer": None,
        "image_processor": None,
        "min_pixels": None,
        "max_pixels": None,
        "labels": "assistant",
        "system_prompt": None,
        "fps": 2.0,
        "max_frames": None,
        "concurrency": 1,
        "max_seq_len": None,
        "max_bad_records": 100,
    },
    "parquet": {"paths": REQUIRED},
    "json": {"paths": REQUIRED},
}


def parse_data(value, path: str) -> dict:
    if not isinstance(value, dict) or value.get("type") not in DATA:
        fail(
            f"{path}={value!r}: must be a mapping with type one of {list(DATA)}, e.g. "
            "{type: digits, num_samples: 512}."
        )
    d = section({k: v for k, v in value.items() if k != "type"}, path, DATA[value["type"]])
    keys = ("num_samples", "start", "image_size", "min_pixels", "max_pixels", "max_frames")
    for k in (*keys, "concurrency", "max_seq_len", "max_bad_records"):
        if d.get(k) is not None:
            check(d[k], f"{path}.{k}", int, "an int")
    if d.get("fps") is not None:
        check(d["fps"], f"{path}.fps", (int, float), "a number")
    for k in ("user_turn", "assistant_turn"):
        if k in d and not (isinstance(d[k], list) and len(d[k]) == 2):
            fail(f"{path}.{k}={d[k]!r}: must be [prefix, suffix].")
    if "labels" in d:
        from ray_disagg.data.conversations import LABEL_MODES

        if d["labels"] not in LABEL_MODES:
            fail(f"{path}.labels={d['labels']!r}: must be one of {list(LABEL_MODES)}.")
    return {"type": value["type"], **d}


def _local(path: str, key: str) -> str:
    path = os.path.expanduser(str(path))
    if "://" not in path and not os.path.exists(path):
        fail(f"{key}={path!r}: no such file or directory.")
    return path


def build_dataset(recipe, which: str):
    """Load ``recipe.data[which]`` (Ray Data sources need Ray to be initialized)."""
    d, key = recipe.data[which], f"data.{which}"
    config = recipe.model.load_config()
    if d["type"] == "digits":
        from ray_disagg.data.examples import digits_samples

        with at(key):
            return digits_samples(
                config, n=d["num_samples"], image_size=d["image_size"], start=d["start"]
            )
    if d["type"] in ("parquet", "json"):
        import ray.data

        paths = d["paths"] if isinstance(d["paths"], list) else [d["paths"]]
        paths = [_local(p, f"{key}.paths") for p in paths]
        with at(key):
            return getattr(ray.data, f"read_{d['type']}")(paths)
    tok, proc = _processors(recipe, d, key)
    if d["type"] == "conversations":
        return _conversations(d, key, config, tok, proc)
    from ray_disagg.data.llava import load_llava

    with at(key):
        return load_llava(
            _local(d["annotations"], f"{key}.annotations"),
            image_root=_local(d["image_root"], f"{key}.image_root"),
            tokenizer=tok,
            image_processor=proc,
            config=config,
            user_turn=tuple(d["user_turn"]),
            assistant_turn=tuple(d["assistant_turn"]),
        )


def _conversations(d: dict, key: str, config, tok, proc):
    """A stream of ``.jsonl`` / ``.parquet`` records (a file or a directory); a ``.json``
    list is converted here, at once (small sets)."""
    from ray_disagg.data.conversations import ConversationProcessor, read_records
    from ray_disagg.data.stream import ConversationStream

    root = d["media_root"]
    records = _local(d["records"], f"{key}.records")
    with at(key):
        convert = ConversationProcessor(
            tokenizer=tok,
            image_processor=proc,
            config=config,
            media_root=None if root is None else _local(root, f"{key}.media_root"),
            labels=d["labels"],
            system_prompt=d["system_prompt"],
            fps=d["fps"],
            max_frames=d["max_frames"],
        )
        if records.endswith(".json"):
            return [convert(r) for r in read_records(records)]
        return ConversationStream(
            paths=records,
            processor=convert,
            concurrency=d["concurrency"],
            max_seq_len=d["max_seq_len"],
            max_bad_records=d["max_bad_records"],
        )


def _processors(recipe, d: dict, key: str):
    """The tokenizer and image processor of a data source, from local directories."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = d["tokenizer"] or recipe.model.pretrained_path
    if tok is None:
        fail(
            f"{key}.tokenizer: required (a local tokenizer directory) when the model has no "
            "pretrained_path."
        )
    tok = _local(tok, f"{key}.tokenizer")
    proc = _local(d["image_processor"] or tok, f"{key}.image_processor")
    pixels = {k: d[k] for k in ("min_pixels", "max_pixels") if d[k] is not None}
    with at(key):
        return (
            AutoTokenizer.from_pretrained(tok, local_files_only=True),
            AutoImageProcessor.from_pretrained(proc, local_files_only=True, **pixels),
        )
