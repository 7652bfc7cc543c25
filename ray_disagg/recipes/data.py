"""The data sources of a recipe (``data.train`` / ``data.validation``): parsed without
loading anything (for ``plan``), loaded for ``train``.

- ``{type: digits, num_samples: N, start: 0, image_size: 16}``: scikit-learn's digits
  (:func:`ray_disagg.data.examples.digits_samples`), samples ``start .. start + N``;
- ``{type: conversations, records: F, media_root: D, tokenizer, image_processor,
  feature_extractor (audio families), video_processor (Qwen3-VL, InternVL,
  LLaVA-OneVision), min_pixels, max_pixels, labels, system_prompt, fps, max_frames,
  concurrency, max_seq_len, max_bad_records}``:
  LLaVA or messages records through the tokenizer's chat template and the family's
  image / video / audio processing
  (:class:`ray_disagg.data.conversations.ConversationProcessor`; ``labels``: ``assistant``,
  ``last`` or ``all``), tokenizer and image processor from local directories (default:
  ``model.pretrained_path``). ``.jsonl`` / ``.parquet`` files or a directory of them are
  streamed (:class:`ray_disagg.data.stream.ConversationStream`, resumable); a ``.json``
  list is converted at once;
- ``{type: preference, records: F, ...}``: TRL's conversational preference records
  (``prompt``, ``chosen``, ``rejected``, ``images``) as DPO pairs
  (:class:`ray_disagg.data.preference.PreferenceProcessor`; the keys of ``conversations``
  but ``labels``: the labels are the answers), for ``train_loop_config.objective: {type:
  dpo}``;
- ``{type: prompts, records: F, ...}``: TRL's prompt-only records (``prompt``,
  ``images`` and the columns the reward functions read) as prompts for
  ``train_loop_config.objective: {type: grpo}`` to complete
  (:class:`ray_disagg.data.prompts.PromptProcessor`; the keys of ``preference``);
- ``{type: parquet | json, paths: P}``: a Ray Data dataset (``ray.data.read_<type>``);
- a list of map-style sources, each with a ``name`` and a ``weight``: a training mixture
  (:func:`ray_disagg.mix`), e.g. ``[{name: captions, weight: 0.7, type: digits,
  num_samples: 512}, {name: chat, weight: 0.3, type: conversations, records: chat.json}]``.

Example:
    >>> parse_data({"type": "digits", "num_samples": 8}, "data.train")["start"]
    0
"""

from __future__ import annotations

import logging
import math
import os

from ray_disagg.recipes.schema import REQUIRED, at, check, fail, section

__all__ = [
    "DATA",
    "build_dataset",
    "check_sources",
    "data_spec",
    "parse_data",
    "reads_ray_data",
]

logger = logging.getLogger(__name__)

CONVERSATIONS = {
    "records": REQUIRED,
    "media_root": None,
    "tokenizer": None,
    "image_processor": None,
    "feature_extractor": None,
    "video_processor": None,
    "min_pixels": None,
    "max_pixels": None,
    "labels": "assistant",
    "system_prompt": None,
    "fps": 2.0,
    "max_frames": None,
    "concurrency": 1,
    "num_cpus": 1.0,
    "max_seq_len": None,
    "max_bad_records": 100,
}
TYPE_HELP = {
    "digits": "scikit-learn's handwritten digits captioned (`a handwritten seven`), made "
    "in memory (`ray_disagg.data.examples.digits_samples`)",
    "conversations": "conversation records (`conversations` or `messages` lists; "
    "docs/data.md) through the tokenizer's chat template and "
    "the family's processors (`ConversationProcessor`); `.jsonl` / `.parquet` files or a "
    "directory of them are streamed, a `.json` list is converted at once",
    "preference": "TRL's conversational preference records (`prompt`, `chosen`, `rejected`, "
    "`images`) as DPO pairs, for `objective: {type: dpo}`",
    "prompts": "TRL's prompt-only records (`prompt`, `images` and the reward functions' "
    "columns) for `objective: {type: grpo}` to complete",
    "parquet": "a Ray Data dataset of ready samples (`ray.data.read_parquet`)",
    "json": "a Ray Data dataset of ready samples (`ray.data.read_json`)",
}
"""What each data type is (the recipe reference, ``ray_disagg.recipes.reference``)."""
KEY_HELP = {
    "num_samples": "how many samples (default: all 1797)",
    "start": "the first image's index (e.g. 1600 for a held-out set)",
    "image_size": "images resized to this square side",
    "records": "the records: a `.json` list, `.jsonl` or `.parquet` file, or a directory of them",
    "media_root": "the directory relative media paths start from",
    "tokenizer": "a local tokenizer directory with the chat template (default: "
    "`model.pretrained_path`)",
    "image_processor": "a local image processor directory (default: the tokenizer's)",
    "feature_extractor": "the audio feature extractor's directory (audio families; "
    "default: the tokenizer's)",
    "video_processor": "the video processor's directory where the family reads one "
    "(default: the tokenizer's)",
    "min_pixels": "the image processor's `min_pixels`",
    "max_pixels": "the image processor's `max_pixels`",
    "labels": "the tokens with a loss: `assistant` (every assistant turn), `last` or `all`",
    "system_prompt": "a system message put first where a record has none",
    "fps": "video frames sampled per second of video",
    "max_frames": "at most this many frames per video",
    "concurrency": "Ray Data actors processing a streamed source",
    "num_cpus": "CPUs each of those actors reserves",
    "max_seq_len": "records longer than this many tokens are skipped (and counted)",
    "max_bad_records": "unreadable records tolerated before the run fails",
    "paths": "the files or directories Ray Data reads",
}
"""What each data key is (the recipe reference)."""
DATA = {  # type -> keys (with defaults)
    "digits": {"num_samples": None, "start": 0, "image_size": 16},
    "conversations": CONVERSATIONS,
    "preference": {k: v for k, v in CONVERSATIONS.items() if k != "labels"},  # the answers
    "prompts": {k: v for k, v in CONVERSATIONS.items() if k != "labels"},  # nothing labelled
    "parquet": {"paths": REQUIRED},
    "json": {"paths": REQUIRED},
}


def parse_data(value, path: str) -> dict:
    if isinstance(value, list):
        return _parse_mixture(value, path)
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
    for k in ("fps", "num_cpus"):
        if d.get(k) is not None:
            check(d[k], f"{path}.{k}", (int, float), "a number")
    if "labels" in d:
        from ray_disagg.data.conversations import LABEL_MODES

        if d["labels"] not in LABEL_MODES:
            fail(f"{path}.labels={d['labels']!r}: must be one of {list(LABEL_MODES)}.")
    return {"type": value["type"], **d}


def _parse_mixture(value: list, path: str) -> dict:
    """``{"type": "mixture", "sources": [{name, weight, <source>}, ...]}``."""
    if path != "data.train" or not value:
        fail(f"{path}: a list of sources (a mixture) is for data.train, with one or more.")
    sources, names = [], set()
    for k, item in enumerate(value):
        where = f"{path}[{k}]"
        if not isinstance(item, dict) or "name" not in item or "weight" not in item:
            fail(f"{where}={item!r}: a mixture's source needs a name and a weight.")
        name, weight = item["name"], item["weight"]
        check(name, f"{where}.name", str, "a string")
        check(weight, f"{where}.weight", (int, float), "a number > 0")
        if not math.isfinite(weight) or weight <= 0:
            fail(
                f"{where}.weight={weight!r}: must be a number > 0 (drop a source to leave it out)."
            )
        if name in names:
            fail(f"{where}.name={name!r}: another source has that name.")
        names.add(name)
        d = parse_data({k: v for k, v in item.items() if k not in ("name", "weight")}, where)
        if _kind(d) != "map":
            fail(
                f"{where}: a mixture takes map-style sources (digits, conversations from a "
                f".json list), not {d['type']} {'records' if 'records' in d else 'paths'}."
            )
        sources.append({"name": name, "weight": weight, **d})
    return {"type": "mixture", "sources": sources}


def _kind(d: dict) -> str:
    if d["type"] in ("parquet", "json"):
        return "ray"
    records = d["type"] in ("conversations", "preference", "prompts")
    if records and not str(d["records"]).endswith(".json"):
        return "stream"
    return "map"


def _local(path: str, key: str) -> str:
    path = os.path.expanduser(str(path))
    if "://" not in path and not os.path.exists(path):
        fail(f"{key}={path!r}: no such file or directory.")
    return path


def data_spec(data: dict):
    """The ``ray_disagg.config.layout.DataSpec`` of a recipe's parsed ``data`` (``{"train": ...,
    "validation": ...}``), without loading it: what ``build_dataset`` makes of the
    training source is ``"map"`` (digits, a ``.json`` list of conversation records),
    ``"ray"`` (parquet, json) or ``"stream"`` (conversation records in ``.jsonl`` /
    ``.parquet`` files or a directory)."""
    from ray_disagg.config.layout import DataSpec

    d = data["train"]
    kind = "map" if d["type"] == "mixture" else _kind(d)
    pairs = True if d["type"] == "preference" else None if kind == "ray" else False
    prompts = {"prompts": True, "conversations": False, "preference": False}.get(d["type"])
    return DataSpec(kind=kind, validation="validation" in data, pairs=pairs, prompts=prompts)


def build_dataset(recipe, which: str):
    """Load ``recipe.data[which]`` (Ray Data sources need Ray to be initialized)."""
    d, key = recipe.data[which], f"data.{which}"
    if d["type"] == "mixture":
        from ray_disagg.data.mixture import mix

        built = {s["name"]: _build(recipe, s, f"{key}[{s['name']}]") for s in d["sources"]}
        with at(key):  # the run's seed draws the samples
            weights = {s["name"]: s["weight"] for s in d["sources"]}
            return mix(built, weights=weights, seed=recipe.loop.seed)
    return _build(recipe, d, key)


def _build(recipe, d: dict, key: str):
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
    return _conversations(d, key, config, tok, proc)


def _conversations(d: dict, key: str, config, tok, proc):
    """A stream of ``.jsonl`` / ``.parquet`` records (a file or a directory); a ``.json``
    list is converted here, at once (small sets)."""
    from ray_disagg.data.conversations import ConversationProcessor, read_records
    from ray_disagg.data.preference import PreferenceProcessor
    from ray_disagg.data.prompts import PromptProcessor
    from ray_disagg.data.stream import ConversationStream

    root = d["media_root"]
    records = _local(d["records"], f"{key}.records")
    with at(key):
        convert = ConversationProcessor(
            tokenizer=tok,
            image_processor=proc,
            config=config,
            media_root=None if root is None else _local(root, f"{key}.media_root"),
            labels=d.get("labels", "last"),
            system_prompt=d["system_prompt"],
            fps=d["fps"],
            max_frames=d["max_frames"],
            feature_extractor=_feature_extractor(d, key, config, tok.name_or_path),
            video_processor=_video_processor(d, key, config, tok.name_or_path),
        )
        if d["type"] == "preference":
            convert = PreferenceProcessor(convert)
        elif d["type"] == "prompts":
            convert = PromptProcessor(convert)
        if records.endswith(".json"):
            return [convert(r) for r in read_records(records)]
        return ConversationStream(
            paths=records,
            processor=convert,
            concurrency=d["concurrency"],
            num_cpus=d["num_cpus"],
            max_seq_len=d["max_seq_len"],
            max_bad_records=d["max_bad_records"],
        )


def _feature_extractor(d: dict, key: str, config, tok_dir: str):
    """The audio feature extractor of a family with an audio tower (``None`` otherwise),
    from ``feature_extractor`` or the tokenizer's directory."""
    from transformers import AutoFeatureExtractor

    from ray_disagg.models import get_adapter

    if "audios" not in get_adapter(config).media:
        return None

    path = _local(d["feature_extractor"] or tok_dir, f"{key}.feature_extractor")
    with at(key):
        return AutoFeatureExtractor.from_pretrained(path, local_files_only=True)


def _video_processor(d: dict, key: str, config, tok_dir: str):
    """The family's video processor or its settings (its adapter's
    ``load_video_processor``: Qwen3-VL's class; InternVL's and LLaVA-OneVision's
    ``video_preprocessor_config.json`` as a mapping, ``None`` without one), from
    ``video_processor`` or the tokenizer's directory; ``None`` for families that cut video
    frames with the image processor."""
    from ray_disagg.models import get_adapter

    adapter = get_adapter(config)
    if not adapter.reads_video_processor:
        return None
    path = _local(d["video_processor"] or tok_dir, f"{key}.video_processor")
    with at(key):
        return adapter.load_video_processor(path)


def _processors(recipe, d: dict, key: str):
    """The tokenizer and image processor of a data source, from local directories."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = _local(_tokenizer(recipe, d, key), f"{key}.tokenizer")
    proc = _local(d["image_processor"] or tok, f"{key}.image_processor")
    pixels = {k: d[k] for k in ("min_pixels", "max_pixels") if d[k] is not None}
    with at(key):
        return (
            AutoTokenizer.from_pretrained(tok, local_files_only=True),
            AutoImageProcessor.from_pretrained(proc, local_files_only=True, **pixels),
        )


def _tokenizer(recipe, d: dict, key: str) -> str:
    # plan's fallback to the inline config when the weights are elsewhere keeps the path
    named = (recipe.raw.get("model") or {}).get("pretrained_path")
    tok = d["tokenizer"] or recipe.model.pretrained_path or named
    if tok is None:
        fail(
            f"{key}.tokenizer: required (a local tokenizer directory with the chat "
            "template) when the model has no pretrained_path; set model.pretrained_path or "
            f"{key}.tokenizer."
        )
    return tok


def _sources(data: dict):
    """``(key path, source)`` of every source of the recipe's data (a mixture's each)."""
    for which, d in data.items():
        if d["type"] == "mixture":
            yield from ((f"data.{which}[{s['name']}]", s) for s in d["sources"])
        else:
            yield f"data.{which}", d


def reads_ray_data(data: dict) -> bool:
    """Whether a source of the recipe's data is a Ray Dataset (``parquet``, ``json``),
    which needs Ray to be built; the others (and the trainer's checks of their samples)
    need none."""
    return any(d["type"] in ("parquet", "json") for _, d in _sources(data))


def check_sources(recipe, for_training: bool) -> None:
    """The checks of the recipe's data that load nothing, every refusal together: a
    record source's tokenizer is named; with ``for_training`` its local files exist
    (``plan`` may plan a run whose files are on the cluster only)."""
    from ray_disagg.config.refusals import Refusals

    refusals = Refusals()
    for key, d in _sources(recipe.data):
        if d["type"] not in ("conversations", "preference", "prompts"):
            continue
        tok = None
        with refusals.check():
            tok = _tokenizer(recipe, d, key)
        if not for_training:
            continue
        paths = {"records": d["records"], "media_root": d["media_root"], "tokenizer": tok,
                 "image_processor": d["image_processor"]}  # fmt: skip
        for name, path in paths.items():
            if path is not None:
                with refusals.check():
                    _local(path, f"{key}.{name}")
    refusals.raise_any()
