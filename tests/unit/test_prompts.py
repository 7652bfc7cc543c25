"""Tier 1: TRL's prompt-only records through the chat template and the image processor
(``PromptProcessor``): the prompt's tokens are the template's own rendering with the
generation prompt (the shared oracle), the images expanded as the family's processor
does, nothing labelled, the other columns kept for the reward functions; GRPO takes the
sample as a prompt to complete; bad records named; the recipe's ``prompts`` data type."""

import json

import pytest

from ray_disagg import GRPO, tiny_qwen2_5_vl_config
from ray_disagg.data.prompts import PromptProcessor
from ray_disagg.recipes.data import data_spec, parse_data
from tests.conversation_data import build_media, build_model_dir, make_processor, qwen_oracle

CFG = tiny_qwen2_5_vl_config()


def record(images=("a.png",), prompt=None) -> dict:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "which digit?"}]
    return {"id": "q1", "prompt": prompt or [{"role": "user", "content": content}],
            "images": list(images), "solution": "seven."}  # fmt: skip


def reward(prompts, completions, solution, **kwargs):
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    media = build_media(root)
    return make_processor(build_model_dir(root / "model"), media, CFG), media


@pytest.mark.parametrize("images", [(), ("a.png",), ("a.png", "b.jpg")])
def test_prompts_follow_the_template_with_the_generation_prompt(setup, images):
    proc, media = setup
    rec = record(images)
    sample = PromptProcessor(proc)(rec)
    messages = [{**rec["prompt"][0], "content": [
        {**p, "image": images[i]} if p["type"] == "image" else p
        for i, p in enumerate(rec["prompt"][0]["content"])]}]  # fmt: skip
    want = qwen_oracle(proc, messages, list(images), media, add_generation_prompt=True)
    assert sample["input_ids"].tolist() == want
    assert proc.tokenizer.decode(want[-3:]).split()[-1] == "assistant"  # the header last
    assert sample["solution"] == "seven." and sample["prompt"] == rec["prompt"]
    assert sample["images"] == list(images) and "labels" not in sample  # TRL passes them
    assert (sample["image_grid_thw"] is None) == (not images)
    obj = GRPO(reward_funcs=[reward], num_generations=2, rollouts="generate")
    obj.check_sample(sample)
    obj.check_columns(sample)
    (seq,) = obj.sequences(sample)  # the prompt and room for its longest completion
    assert len(seq["input_ids"]) == len(want) + obj.max_completion_length


def test_a_string_prompt_is_one_user_message(setup):
    proc, _ = setup
    sample = PromptProcessor(proc)(
        {"id": "s", "prompt": "which digit is this?", "solution": "two."}
    )
    text = proc.tokenizer.decode(sample["input_ids"].tolist())
    assert "which digit is this?" in text and text.rstrip().endswith("assistant")


def test_images_without_image_parts_go_first_as_trl_puts_them(setup):
    """TRL's ``prepare_multimodal_messages``: a prompt without image parts gets its
    images before the first user message's text; a single ``image`` column counts."""
    proc, media = setup
    text = [{"role": "user", "content": "which digit?"}]
    parts = [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                          {"type": "text", "text": "which digit?"}]}]  # fmt: skip
    want = qwen_oracle(proc, parts, ["a.png"], media, add_generation_prompt=True)
    for rec in ({"id": "q", "prompt": text, "images": ["a.png"]},
                {"id": "q", "prompt": text, "image": "a.png"}):  # fmt: skip
        assert PromptProcessor(proc)(rec)["input_ids"].tolist() == want


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"images": ["a.png", "b.jpg"]}, "1 of its images are left over"),
        ({"images": []}, r"more \{'type': 'image'\} parts than 'images'"),
        ({"prompt": []}, "'prompt' must be a non-empty list of messages"),
        ({"prompt": [{"role": "user"}]}, "'prompt' must be a non-empty list of messages"),
        ({"completion": [{"role": "assistant", "content": "x"}]}, "holds an answer"),
    ],
)
def test_bad_prompt_records_are_named(setup, change, match):
    proc, _ = setup
    with pytest.raises(ValueError, match=rf"record 'q1'.*{match}"):
        PromptProcessor(proc)(record() | change)


def test_the_recipe_prompts_type_streams_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(record()) + "\n")
    d = parse_data({"type": "prompts", "records": str(path)}, "data.train")
    assert d["type"] == "prompts" and "labels" not in d
    spec = data_spec({"train": d})
    assert spec.kind == "stream" and spec.pairs is False and not spec.recorded
