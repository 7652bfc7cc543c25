"""Prompt records for the tests of GRPO's generated rollouts: the synthetic samples'
prompts with a question and a digit, and a word-level tokenizer over the tiny model's
ids."""

import numpy as np

from ray_disagg.data.examples import NUMBER_WORDS, WORDS, synthetic_samples

GRIDS = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8)]


def build_tokenizer(path) -> None:
    """A word-level tokenizer over the tiny model's 128 ids (``WORDS`` first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [f"w{i}" for i in range(len(WORDS), 128)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(path)


def prompts_of(cfg, n: int, seed: int = 1) -> list[dict]:
    """Each synthetic sample's prompt (its text up to the caption), a question and the
    digit a reward function looks for."""
    out = []
    for s in synthetic_samples(cfg, n, seed=seed, grids=GRIDS):
        labels, ids = np.asarray(s.pop("labels")), np.asarray(s.pop("input_ids"))
        cut = int(np.argmax(labels != -100))
        solution = NUMBER_WORDS[s["id"] % 10]
        out.append({**s, "input_ids": ids[:cut], "prompt": "which digit?", "solution": solution})
    return out
