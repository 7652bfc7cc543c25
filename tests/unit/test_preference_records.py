"""Tier 1: TRL's conversational preference records through the chat template and the
image processor (``PreferenceProcessor``): each answer after the same prompt tokens, the
token ids of the template's own rendering (the shared oracle), labels on the answer and
its end-of-turn only (never the prompt, not an earlier assistant turn), the images
processed once; bad records named; SFT data given to DPO and pairs given to SFT refused
on the driver; the recipe's ``preference`` data type."""

import json

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import DPO, DisaggregatedTrainer, HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
from ray_disagg.data.preference import PreferenceProcessor
from ray_disagg.data.stream import ConversationStream
from ray_disagg.recipes.data import data_spec, parse_data
from tests.conversation_data import build_media, build_model_dir, make_processor, qwen_oracle
from tests.preference_records import MULTI_TURN, pair_record

CFG = tiny_qwen2_5_vl_config()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    media = build_media(root)
    return make_processor(build_model_dir(root / "model"), media, CFG), media, root


def labelled_text(proc, ids, labels) -> str:
    keep = np.asarray(labels) != -100
    return proc.tokenizer.decode(np.asarray(ids)[keep].tolist())


@pytest.mark.parametrize(
    "record", [pair_record(0), pair_record(2), MULTI_TURN], ids=lambda r: r["id"]
)
def test_pairs_follow_the_template_with_labels_on_the_answers(setup, record):
    proc, media, _ = setup
    pair = PreferenceProcessor(proc)(record)
    paths = list(record["images"])
    for answer in ("chosen", "rejected"):
        prompt = []
        images = list(paths)
        for m in record["prompt"]:
            c = m["content"]
            if isinstance(c, list):
                c = [{**p, "image": images.pop(0)} if p["type"] == "image" else p for p in c]
            prompt.append({**m, "content": c})
        want = qwen_oracle(proc, prompt + record[answer], paths, media)
        assert pair[f"{answer}_input_ids"].tolist() == want
        content = record[answer][0]["content"]
        text = content if isinstance(content, str) else content[0]["text"]
        got = labelled_text(proc, pair[f"{answer}_input_ids"], pair[f"{answer}_labels"])
        assert got.split() == [*text.split(), "<|im_end|>"]  # the answer and its end of turn
    c, r = pair["chosen_labels"], pair["rejected_labels"]
    n = int(np.argmax(c != -100))
    assert n == int(np.argmax(r != -100))
    assert pair["chosen_input_ids"][:n].tolist() == pair["rejected_input_ids"][:n].tolist()
    grids = pair.get("image_grid_thw")
    assert (0 if grids is None else len(grids)) == len(paths)  # the prompt's images, once
    assert "input_ids" not in pair and pair["id"] == record["id"]


def answer(content) -> list[dict]:
    return [{"role": "assistant", "content": content}]


BAD = [
    ({"chosen": answer([{"type": "image"}])}, r"'chosen' holds \['image'\] parts; media belong"),
    ({"rejected": answer("  ")}, "the rejected answer is empty"),
    ({"chosen": answer("two."), "rejected": answer("two.")}, "chosen and rejected are the same"),
    ({"rejected": None}, r"'rejected' must be a non-empty list of messages"),
    (
        {"chosen": [{"role": "user", "content": "x"}, *answer("two.")]},
        r"exactly the assistant's answer .* roles \['user', 'assistant'\]",
    ),
    ({"images": ["a.png", "b.jpg"]}, "1 of its images are left over"),
    ({"images": []}, r"more \{'type': 'image'\} parts than 'images'"),
    ({"images": ["nothing.png"]}, "cannot read image"),
]


@pytest.mark.parametrize(("change", "match"), BAD)
def test_bad_pairs_name_the_record(setup, change, match):
    proc, _, _ = setup
    record = {**pair_record(1), **change}  # one image
    with pytest.raises(ValueError, match="record 'p1'.*" + match):
        PreferenceProcessor(proc)(record)
    sft = {"id": "s", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValueError, match="record 's' is a conversation \\(SFT\\) record"):
        PreferenceProcessor(proc)(sft)


def g():
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=1))


def test_sft_streams_for_dpo_and_pair_streams_without_it_are_refused(setup):
    proc, _, root = setup
    path = root / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(pair_record(i)) for i in range(4)) + "\n")

    def make(processor, loop):
        stream = ConversationStream(paths=path, processor=processor)
        return DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": g(), "text": g()},
            train_loop_config={"max_steps": 1, "global_batch_size": 2, **loop},
            datasets={"train": stream},
        )

    with pytest.raises(ValueError, match=r"holds preference pairs .* set .*DPO\(beta=0.1\)"):
        make(PreferenceProcessor(proc), {})
    with pytest.raises(ValueError, match="makes SFT samples; stream TRL preference records"):
        make(proc, {"objective": DPO()})
    with pytest.raises(ValueError, match=r"precompute'\) reads map-style datasets"):
        make(PreferenceProcessor(proc), {"objective": DPO(reference="precompute")})
    assert make(PreferenceProcessor(proc), {"objective": DPO()}).loop_config.objective


def test_the_recipe_preference_type():
    d = parse_data({"type": "preference", "records": "pairs.jsonl"}, "data.train")
    assert d["system_prompt"] is None and "labels" not in d
    assert data_spec({"train": d}).pairs is True and data_spec({"train": d}).kind == "stream"
    conv = parse_data({"type": "conversations", "records": "c.json"}, "data.train")
    assert data_spec({"train": conv}).pairs is False
