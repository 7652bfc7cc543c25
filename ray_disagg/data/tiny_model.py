"""A complete tiny model directory made here, with no download: a family's tiny config
with random weights, a word-level tokenizer (built here with ``tokenizers``) carrying the
family's chat template and special tokens (its adapter's ``tiny_chat``), the family's
image processor, and example records over scikit-learn's handwritten digits in
``examples/``: conversations with images (SFT, LoRA), TRL preference pairs (DPO) and TRL
prompts with a ``solution`` column (GRPO, :func:`digit_reward`). The bundled CPU recipes
build it on first use (``model.build_if_missing``).

Example:
    >>> import tempfile
    >>> from ray_disagg import tiny_qwen2_5_vl_config
    >>> d = save_tiny_model(tempfile.mkdtemp() + "/tiny", tiny_qwen2_5_vl_config(), examples=4)
    >>> sorted(os.listdir(d + "/examples"))[:3]
    ['captions.json', 'captions_val.json', 'images']
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import numpy as np

__all__ = ["QUESTION", "RECORD", "WORDS", "digit_reward", "save_tiny_model"]

RECORD = "tiny_model.json"
"""In a built directory: what it was built from (the config and the seed)."""
DIGITS = 1797  # scikit-learn's handwritten digits

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
QUESTION = "which digit is this?"
WORDS = ["[PAD]", "[UNK]", "system", "user", "assistant", "You", "are", "a", "helpful"]
WORDS += ["assistant.", *QUESTION.split(), "handwritten", *NUMBERS, *(w + "." for w in NUMBERS)]
"""The tokenizer's words (ids in order); the family's special tokens follow at their ids."""


def _tokenizer(directory: str, adapter) -> int:
    """Save the tokenizer; returns the end-of-turn token's id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, special, end = adapter.tiny_chat()
    vocab_size = getattr(adapter.config, "text_config", adapter.config).vocab_size
    if max(special.values()) >= vocab_size or min(special.values()) < len(WORDS):
        raise ValueError(
            f"the tiny tokenizer's special ids {sorted(special.values())} must lie in "
            f"[{len(WORDS)}, {vocab_size}) (the config's vocab_size)."
        )
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)} | special, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token=end
    )
    fast.add_special_tokens({"additional_special_tokens": list(special)})
    fast.chat_template = template
    fast.save_pretrained(directory)
    return special[end]


def _digits(n: int, image_size: int) -> tuple[list, list[int]]:
    """The first ``n`` of scikit-learn's digits as ``image_size`` square RGB images."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = []
    for pixels in digits.images[:n]:
        gray = Image.fromarray((pixels / 16 * 255).astype(np.uint8))
        images.append(gray.resize((image_size, image_size)).convert("RGB"))
    return images, [int(y) for y in digits.target[:n]]


def _records(images: list[str], targets: list[int]) -> dict[str, list[dict]]:
    """Each example set's records, per file stem."""
    out = {"captions": [], "pairs": [], "prompts": []}
    for k, (path, y) in enumerate(zip(images, targets)):
        user = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        answer = f"a handwritten {NUMBERS[y]}."
        wrong = f"a handwritten {NUMBERS[(y + 5) % 10]}."
        out["captions"].append({
            "id": k,
            "messages": [{"role": "user", "content": [{"type": "image", "image": path},
                                                     user[1]]},
                         {"role": "assistant", "content": answer}],
        })  # fmt: skip
        prompt = [{"role": "user", "content": user}]
        out["pairs"].append({
            "id": k, "prompt": prompt, "images": [path],
            "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": wrong}],
        })  # fmt: skip
        out["prompts"].append({"id": k, "prompt": prompt, "images": [path], "solution": NUMBERS[y]})
    return out


def _examples(directory: str, image_size: int, train: int, validation: int) -> None:
    """``examples/``: the images and, per set, ``<set>.json`` (the first ``train``
    images) and ``<set>_val.json`` (the next ``validation``)."""
    root = os.path.join(directory, "examples")
    os.makedirs(os.path.join(root, "images"))
    images, targets = _digits(train + validation, image_size)
    paths = []
    for k, image in enumerate(images):
        paths.append(f"images/{k}.png")
        image.save(os.path.join(root, paths[-1]))
    for split, sl in (("", slice(0, train)), ("_val", slice(train, None))):
        for name, records in _records(paths[sl], targets[sl]).items():
            with open(os.path.join(root, f"{name}{split}.json"), "w", encoding="utf-8") as f:
                json.dump(records, f)


def _built_from(config, seed: int) -> dict:
    return json.loads(json.dumps({"config": config.to_dict(), "seed": seed}, default=str))


def _check_built(directory: str, config, seed: int) -> None:
    """A directory built here before must have been built from ``config`` and ``seed``."""
    path = os.path.join(directory, RECORD)
    if config is None or not os.path.isfile(path):
        return  # a model directory of another origin is taken as it is
    with open(path, encoding="utf-8") as f:
        if json.load(f) != _built_from(config, seed):
            raise ValueError(
                f"{directory!r} holds a tiny model built from another config or seed; give "
                "another path (or delete it to build it anew)."
            )


def _write(directory: str, config, seed: int, image_size: int, train: int, validation: int):
    from ray_disagg.model import HFModelSpec
    from ray_disagg.models import get_adapter

    with open(os.path.join(directory, RECORD), "w", encoding="utf-8") as f:
        json.dump(_built_from(config, seed), f)
    config = copy.deepcopy(config)
    adapter = get_adapter(config)
    end = _tokenizer(directory, adapter)
    getattr(config, "text_config", config).eos_token_id = end  # completions end there
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: no bar among plan's lines
    try:
        HFModelSpec(config=config, seed=seed).build_full().save_pretrained(directory)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    adapter.build_image_processor(image_size * image_size).save_pretrained(directory)
    _examples(directory, image_size, train, validation)


def save_tiny_model(
    directory,
    config,
    *,
    seed: int = 0,
    image_size: int = 16,
    examples: int = 64,
    validation: int = 16,
) -> str:
    """Write the complete tiny model directory of ``config`` (a tiny config; weights from
    ``seed``) to ``directory`` unless it holds a ``config.json`` already; returns its
    absolute path. Images are ``image_size`` square; ``examples`` train and
    ``validation`` held-out records per set (0 and 0: no records). Written to a temporary
    directory beside it first, then renamed into place, so concurrent callers leave one
    complete copy; a directory built before from another config or seed is a
    ``ValueError``. Needs scikit-learn and Pillow (the ``test`` extra)."""
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if os.path.isfile(os.path.join(directory, "config.json")):
        _check_built(directory, config, seed)
        return directory
    if min(examples, validation) < 0 or examples + validation > DIGITS:
        raise ValueError(
            f"examples={examples}, validation={validation}: each at least 0, together at "
            f"most {DIGITS} (scikit-learn's digits)."
        )
    if os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(
            f"{directory!r} exists without a config.json: not a model directory; give an "
            "empty or new path."
        )
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}-", dir=parent)
    try:
        _write(tmp, config, seed, image_size, examples, validation)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the model from other users
        try:
            os.rename(tmp, directory)
        except OSError:  # another process put its copy there first
            if not os.path.isfile(os.path.join(directory, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def digit_reward(completions, solution, **_) -> list[float]:
    """A GRPO reward function for the tiny model's prompts (TRL's signature): 1.0 where the
    digits a completion names are exactly the record's (``solution``), else 0.0."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    named = [[w for w in t.replace(".", " ").split() if w in NUMBERS] for t in texts]
    return [float(n == [s]) for n, s in zip(named, solution)]
