"""Tier 1: the recipe keys' reference in docs/recipes-and-cli.md is generated from the
schema and current; every key has its description; each bundled CPU recipe is named on
its docs page; the tiny model directory the CPU recipes build holds what they read."""

import json
import pathlib

import pytest

from ray_disagg.recipes import reference
from ray_disagg.recipes.data import DATA, KEY_HELP, TYPE_HELP
from ray_disagg.recipes.sections import MODEL, MODEL_HELP

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "recipes-and-cli.md"


def test_the_reference_on_the_page_is_current():
    text = PAGE.read_text()
    assert reference.replace(text) == text, (
        "stale: python -m ray_disagg.recipes.reference --write docs/recipes-and-cli.md"
    )


def test_every_key_and_type_is_described():
    assert set(MODEL) == set(MODEL_HELP)
    assert set(DATA) == set(TYPE_HELP)
    assert {k for keys in DATA.values() for k in keys} == set(KEY_HELP)


def test_the_page_without_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        reference.replace("no markers here")


@pytest.mark.parametrize(
    "recipe, page",
    [
        ("sft_cpu", "recipes-and-cli.md"),
        ("lora_cpu", "lora.md"),
        ("dpo_cpu", "preference-training.md"),
        ("grpo_cpu", "reinforcement-learning.md"),
    ],
)
def test_each_bundled_cpu_recipe_is_on_its_page(recipe, page):
    assert (REPO / "ray_disagg" / "recipes" / f"{recipe}.yaml").is_file()
    assert f"ray-disagg train {recipe}" in (REPO / "docs" / page).read_text()


def test_the_tiny_model_directory_holds_what_the_recipes_read(tmp_path):
    """The tokenizer renders the chat template, labels the answer and ends the turn with
    the config's eos; the preference pairs and prompts go through their processors."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from ray_disagg import tiny_qwen2_5_vl_config
    from ray_disagg.data.conversations import ConversationProcessor, read_records
    from ray_disagg.data.preference import PreferenceProcessor
    from ray_disagg.data.prompts import PromptProcessor
    from ray_disagg.data.tiny_model import digit_reward, save_tiny_model

    d = save_tiny_model(tmp_path / "tiny", tiny_qwen2_5_vl_config(), examples=4, validation=2)
    assert save_tiny_model(d, None) == d  # there already: nothing rebuilt
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    assert (
        cfg.text_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    )
    proc = ConversationProcessor(
        tokenizer=tok,
        image_processor=AutoImageProcessor.from_pretrained(d, local_files_only=True),
        config=cfg,
        media_root=f"{d}/examples",
    )
    captions = read_records(f"{d}/examples/captions.json")
    assert len(captions) == 4 and len(read_records(f"{d}/examples/captions_val.json")) == 2
    sample = proc(captions[0])
    answer = tok.decode([i for i in sample["labels"] if i >= 0])
    assert answer == f"{captions[0]['messages'][1]['content']} <|im_end|>"
    assert (sample["input_ids"] == cfg.image_token_id).sum() == 4  # a 16x16 image: 2x2 merged
    pair = PreferenceProcessor(proc)(read_records(f"{d}/examples/pairs.json")[0])
    assert "chosen_input_ids" in pair and "rejected_input_ids" in pair
    prompt = read_records(f"{d}/examples/prompts.json")[0]
    header = tok.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    assert PromptProcessor(proc)(prompt)["input_ids"][-2:].tolist() == header
    assert digit_reward([answer], [prompt["solution"]]) == [1.0]
    with open(f"{d}/examples/pairs.json") as f:
        first = json.load(f)[0]
    assert first["chosen"] != first["rejected"] and first["images"] == [first["images"][0]]
    with pytest.raises(ValueError, match="another config or seed"):
        save_tiny_model(d, tiny_qwen2_5_vl_config(), seed=1)
    assert digit_reward(["seven.", "a seven or two.", "nothing"], ["seven"] * 3) == [1, 0, 0]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(ValueError, match="not a model directory"):
        save_tiny_model(tmp_path / "other", tiny_qwen2_5_vl_config())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.pretrained_path=null"], "needs model.pretrained_path"),
        (["model.config={model_type: qwen2_5_vl}"], "tiny_\\* preset"),
        (["model.build_if_missing=1"], "true or false"),
    ],
)
def test_build_if_missing_errors_name_the_key(overrides, expected, tmp_path, monkeypatch):
    from ray_disagg.recipes.recipe import load_recipe
    from ray_disagg.recipes.schema import RecipeError

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RecipeError, match=expected):
        load_recipe("sft_cpu", overrides)


def test_build_if_missing_refuses_a_directory_that_is_not_a_model(tmp_path):
    from ray_disagg.recipes.recipe import load_recipe
    from ray_disagg.recipes.schema import RecipeError

    (tmp_path / "x.txt").write_text("")
    with pytest.raises(RecipeError, match=r"model.pretrained_path=.*neither a model directory"):
        load_recipe("sft_cpu", [f"model.pretrained_path={tmp_path}"])
