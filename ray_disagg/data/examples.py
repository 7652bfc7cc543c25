"""Small real image data that ships with a package: scikit-learn's handwritten digits.

Each 8x8 digit becomes an RGB image, is patched by the real Qwen2.5-VL image processor
(``Qwen2VLImageProcessor``) and gets the caption ``"a handwritten seven"``; the loss is
taken on the caption only.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "WORDS",
    "digit_prompts",
    "digits_samples",
    "save_word_tokenizer",
    "synthetic_pairs",
    "synthetic_prompts",
    "synthetic_rollouts",
    "synthetic_samples",
]

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Word-level vocabulary of the captions; ids 100-103 are Qwen2.5-VL's vision tokens in
# tiny_qwen2_5_vl_config().
WORDS = ["<pad>", "<bos>", "<eos>", "a", "handwritten", "digit", *NUMBER_WORDS]
PAD, BOS, EOS = 0, 1, 2


def _ids(words: list[str]) -> list[int]:
    return [WORDS.index(w) for w in words]


def _image_processor(config, image_size: int):
    """The family's image processor made from ``config``, images ``image_size`` square."""
    from ray_disagg.models import get_adapter

    return get_adapter(config).build_image_processor(image_size * image_size)


def caption_sample(config, pixel_values, grid_thw, words: list[str], sample_id) -> dict:
    """Build one training sample: ``<bos> <vision_start> <image>*n <vision_end> caption <eos>``
    with labels on the caption and ``<eos>``."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    n_img = int(grid.prod(-1).sum()) // config.vision_config.spatial_merge_size**2
    prefix = [BOS, config.vision_start_token_id] + [config.image_token_id] * n_img
    prefix += [config.vision_end_token_id]
    target = _ids(words) + [EOS]
    ids = np.asarray(prefix + target, dtype=np.int64)
    labels = np.asarray([-100] * len(prefix) + target, dtype=np.int64)
    return {
        "id": sample_id,
        "input_ids": ids,
        "labels": labels,
        "pixel_values": np.asarray(pixel_values, dtype=np.float32),
        "image_grid_thw": grid,
    }


def digits_samples(
    config, n: int | None = None, image_size: int = 16, start: int = 0
) -> list[dict]:
    """``n`` samples from ``sklearn.datasets.load_digits`` (1797 images shipped with
    sklearn), from image ``start`` on (e.g. ``start=1600`` for a held-out set)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("digits_samples needs scikit-learn: pip install scikit-learn") from e
    digits = load_digits()
    images, targets = digits.images[start:], digits.target[start:]
    if n is not None:
        images, targets = images[:n], targets[:n]
    proc = _image_processor(config, image_size)
    rgb = [np.repeat((img / 16.0 * 255).astype(np.uint8)[..., None], 3, axis=-1) for img in images]
    out = []
    for i, (img, y) in enumerate(zip(rgb, targets)):
        enc = proc(images=[img], return_tensors="np")
        words = ["a", "handwritten", NUMBER_WORDS[int(y)]]
        pixels, grid = enc["pixel_values"], enc["image_grid_thw"]
        out.append(caption_sample(config, pixels, grid, words, start + i))
    return out


def synthetic_samples(config, n: int, *, seed: int = 0, grids: list | None = None) -> list[dict]:
    """Random-input samples for any supported family, for tests and benchmarks.

    ``grids`` cycles per sample; each entry is ``None`` (a text-only sample), a ``(t, h, w)``
    tuple (one image) or a dict of modality lists, e.g. ``{"images": [(1, 4, 4), (1, 4,
    8)], "videos": [(2, 4, 4)], "audios": [40]}`` (audio: mel frames, for families with an
    audio encoder; media the family does not take, e.g. videos for Gemma 3, are left
    out). Labels are on the caption and ``<eos>`` only."""
    from ray_disagg.models import get_adapter

    adapter = get_adapter(config)
    rng = np.random.default_rng(seed)
    grids = grids or [(1, 4, 4), (1, 8, 4), (1, 4, 8)]
    out = []
    for i in range(n):
        spec = grids[i % len(grids)]
        spec = {} if spec is None else spec if isinstance(spec, dict) else {"images": [spec]}
        spec = {k: v for k, v in spec.items() if k in adapter.media}
        fields, prefix = adapter.synthetic_inputs(spec, rng)
        words = ["a", "digit", NUMBER_WORDS[int(rng.integers(10))]]
        prefix = [BOS, *prefix]
        target = _ids(words) + [EOS]
        sample = {
            "id": i,
            "input_ids": np.asarray(prefix + target, dtype=np.int64),
            "labels": np.asarray([-100] * len(prefix) + target, dtype=np.int64),
            **fields,
        }
        out.append(sample)
    return out


def synthetic_pairs(config, n: int, *, seed: int = 0, grids: list | None = None) -> list[dict]:
    """Random-input preference pairs (pre-tokenized, for ``ray_disagg.DPO``): each the
    prompt of :func:`synthetic_samples` (media by ``grids``) with two different answers
    of different lengths, ``chosen_input_ids`` / ``chosen_labels`` and
    ``rejected_input_ids`` / ``rejected_labels`` (labels on the answer and ``<eos>``)."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for sample in synthetic_samples(config, n, seed=seed, grids=grids):
        labels = np.asarray(sample.pop("labels"))
        ids = np.asarray(sample.pop("input_ids"))
        prefix = ids[: int(np.argmax(labels != -100))].tolist()
        pair = {}
        first = int(rng.integers(10))
        answers = {"chosen": ["a", NUMBER_WORDS[first]]}
        answers["rejected"] = ["a", "handwritten", "digit", NUMBER_WORDS[(first + 3) % 10]]
        for name, words in answers.items():
            target = _ids(words) + [EOS]
            pair[f"{name}_input_ids"] = np.asarray(prefix + target, dtype=np.int64)
            pair[f"{name}_labels"] = np.asarray([-100] * len(prefix) + target, dtype=np.int64)
        out.append({**sample, **pair})
    return out


def synthetic_rollouts(
    config, n: int, num_generations: int, *, max_completion_length: int = 6, seed: int = 0,
    grids: list | None = None, reward_names=("exact", "short"),
) -> list[dict]:  # fmt: skip
    """Random recorded rollouts (for ``ray_disagg.GRPO``): each the prompt of
    :func:`synthetic_samples` (media by ``grids``) as ``prompt_input_ids``, with
    ``num_generations`` random completions of 1 to ``max_completion_length`` words
    (``<eos>`` last unless the completion is cut at ``max_completion_length``:
    ``truncated``) and per reward name one random reward per completion in {0, 0.5, 1}
    (``None`` now and then; one group of each few with equal rewards)."""
    rng = np.random.default_rng(seed + 2)
    out = []
    for sample in synthetic_samples(config, n, seed=seed, grids=grids):
        labels = np.asarray(sample.pop("labels"))
        ids = np.asarray(sample.pop("input_ids"))
        prompt = ids[: int(np.argmax(labels != -100))]
        completions, truncated = [], []
        for _ in range(num_generations):
            k = int(rng.integers(1, max_completion_length + 2))  # > max: cut there
            words = rng.integers(3, len(WORDS), size=min(k, max_completion_length))
            c = [int(w) for w in words]
            if k <= max_completion_length:
                c[-1] = EOS
            completions.append(np.asarray(c, dtype=np.int64))
            truncated.append(k > max_completion_length)
        same = sample["id"] % 4 == 3  # a group whose rewards are all equal (advantage 0)
        rewards = {}
        for name in reward_names:
            values = [float(v) / 2 for v in rng.integers(0, 3, size=num_generations)]
            values = [values[0]] * num_generations if same else values
            rewards[name] = [None if rng.random() < 0.1 and not same else v for v in values]
        out.append({**sample, "prompt_input_ids": prompt, "completion_ids": completions,
                    "rewards": rewards, "truncated": truncated})  # fmt: skip
    return out


QUESTION = "which digit is this?"


def _as_prompt(sample: dict) -> dict:
    """A caption sample as a GRPO prompt: its text up to the caption, the question (TRL's
    ``prompt`` column) and the caption's digit (``solution``, for a reward function)."""
    labels, ids = np.asarray(sample.pop("labels")), np.asarray(sample.pop("input_ids"))
    cut = int(np.argmax(labels != -100))
    solution = next(WORDS[i] for i in ids[cut:] if WORDS[i] in NUMBER_WORDS)
    return {**sample, "input_ids": ids[:cut], "prompt": QUESTION, "solution": solution}


def synthetic_prompts(config, n: int, *, seed: int = 0, grids: list | None = None) -> list[dict]:
    """Prompts for ``ray_disagg.GRPO`` to complete: each :func:`synthetic_samples`'s text
    up to its caption (media by ``grids``), with ``prompt`` and ``solution`` (the
    caption's digit word) columns."""
    return [_as_prompt(s) for s in synthetic_samples(config, n, seed=seed, grids=grids)]


def digit_prompts(config, n: int | None = None, image_size: int = 16, start: int = 0):
    """:func:`digits_samples` as GRPO prompts: the image, ``solution`` its digit word."""
    return [_as_prompt(s) for s in digits_samples(config, n, image_size, start)]


def save_word_tokenizer(path, vocab_size: int = 128) -> str:
    """Save (``save_pretrained``) a word-level tokenizer over :data:`WORDS` (then
    ``w<id>`` up to ``vocab_size``) to ``path``: the tiny models' ids as words, for
    reward functions that read decoded completions. Returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [f"w{i}" for i in range(len(WORDS), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return str(path)
