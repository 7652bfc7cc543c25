"""Tier 1: reward functions are called as TRL's ``GRPOTrainer`` calls them (keywords,
conversational completions, the record's columns repeated per completion) and a failing
one is named with its prompts."""

import pytest

from ray_disagg.data.examples import WORDS
from ray_disagg.rollout.rewards import RewardError, score


def decode(ids):
    return " ".join(WORDS[i] for i in ids if WORDS[i] not in ("<pad>", "<eos>"))


RECORDS = [
    {"id": "a", "prompt": [{"role": "user", "content": "Which digit?"}], "solution": "seven"},
    {"id": "b", "prompt": [{"role": "user", "content": "And this one?"}], "solution": "two"},
]
COMPLETIONS = [[[3, 13, 2], [3, 8, 2]], [[8, 2], [3, 4, 5, 0]]]  # "a seven", "a two", ...


def exact(prompts, completions, solution, **kwargs):
    return [float(c[0]["content"].split()[-1] == s) for c, s in zip(completions, solution)]


def test_called_as_trl_calls_them():
    seen = {}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, kwargs=kwargs)
        return [None, 1, 2.5, 0]

    out = score([exact, spy], RECORDS, COMPLETIONS, decode)
    assert out == [
        {"exact": [1.0, 0.0], "spy": [None, 1.0]},
        {"exact": [1.0, 0.0], "spy": [2.5, 0.0]},
    ]
    assert seen["prompts"] == [RECORDS[0]["prompt"]] * 2 + [RECORDS[1]["prompt"]] * 2
    assert seen["completions"][0] == [{"role": "assistant", "content": "a seven"}]
    assert seen["ids"] == [[3, 13, 2], [3, 8, 2], [8, 2], [3, 4, 5, 0]]
    assert seen["kwargs"] == {"id": ["a", "a", "b", "b"],
                              "solution": ["seven", "seven", "two", "two"]}  # fmt: skip

    def text(completions, **kwargs):
        return [float(c == "two") for c in completions]

    plain = score([text], [{"id": 0, "prompt": "Which?"}], [[[8, 2], [9]]], decode)
    assert plain == [{"text": [1.0, 0.0]}]  # a plain-text prompt: text completions


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda **kw: 1 / 0, r"reward function bad raised on prompts \['a', 'b'\]: Zero"),
        (lambda **kw: [1.0], r"bad returned 1 values for the 4 completions of prompts"),
        (lambda **kw: None, r"bad returned None for the 4 completions"),
        (lambda **kw: ["yes"] * 4, r"bad returned 'yes' .*a finite number, or None"),
        (lambda **kw: [float("inf")] * 4, r"bad returned inf"),
    ],
)
def test_a_failing_function_is_named_with_its_prompts(fn, match):
    with pytest.raises(RewardError, match=match):
        score([fn], RECORDS, COMPLETIONS, decode, names=["bad"])
