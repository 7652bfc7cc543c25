"""Tier 1: a LLaVA record's text reaches each family's own chat template as written.

For every family, three LLaVA records (a tag followed by a newline, tags mid-sentence,
spaces around an answer) are compared with messages built by hand the way a user of that
family writes them, rendered by the family's own template (``apply_chat_template``)
through a tokenizer that gives every space and newline its own id: the rendered text, the
token ids and the labels agree. Qwen keeps the text as written, InternVL and
LLaVA-OneVision write the newline after an image themselves, Gemma 3 trims each text part.
"""

import numpy as np
import pytest
from transformers import AutoImageProcessor, AutoTokenizer

from ray_disagg import ADAPTERS, tiny_qwen2_5_vl_config
from ray_disagg.data.conversations import ConversationProcessor, to_messages
from ray_disagg.testing.conversations import build_model_dir, build_tile_model_dir
from tests.conversation_data import build_media, qwen_oracle

FAMILIES = ["qwen2_5_vl", "internvl", "llava_onevision", "gemma3"]
IMG = {"type": "image"}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def turn(human: str, gpt: str) -> list[dict]:
    return [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]


RECORDS = {
    "newline": {"image": "a.png", "conversations": turn("<image>\nwhich digit is this?", "seven.")},
    "mid": {
        "images": ["a.png", "b.jpg"],
        "conversations": turn("which <image> and <image> now?", "two."),
    },
    "spaces": {
        "image": "a.png",
        "conversations": turn("<image> which digit is this?", "  seven. "),
    },
}
# what a user of the family writes for each record: Qwen's fine-tuning code replaces the
# tag in place; InternVL's and LLaVA-OneVision's templates add the newline after an image
AS_WRITTEN = {
    "newline": ([IMG, text("\nwhich digit is this?")], "seven."),
    "mid": ([text("which "), IMG, text(" and "), IMG, text(" now?")], "two."),
    "spaces": ([IMG, text(" which digit is this?")], "  seven. "),
}
BY_HAND = {
    "qwen2_5_vl": AS_WRITTEN,
    "gemma3": AS_WRITTEN,  # its template trims every text part itself
    "internvl": AS_WRITTEN | {"newline": ([IMG, text("which digit is this?")], "seven.")},
    "llava_onevision": AS_WRITTEN | {"newline": ([IMG, text("which digit is this?")], "seven.")},
}
# the rendered user turn, read off each family's template
USER_TURN = {
    ("qwen2_5_vl", "newline"): "<|vision_start|><|image_pad|><|vision_end|>\nwhich digit is this?",
    ("qwen2_5_vl", "mid"): "which <|vision_start|><|image_pad|><|vision_end|> and "
    "<|vision_start|><|image_pad|><|vision_end|> now?",
    ("internvl", "newline"): "<IMG_CONTEXT>\nwhich digit is this?",
    ("internvl", "mid"): "which <IMG_CONTEXT>\n and <IMG_CONTEXT>\n now?",
    ("llava_onevision", "newline"): "<image>\nwhich digit is this?",
    ("llava_onevision", "mid"): "<image>\n<image>\nwhich  and  now?",
    ("gemma3", "newline"): "<start_of_image>which digit is this?",
    ("gemma3", "mid"): "which<start_of_image>and<start_of_image>now?",
}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return build_media(tmp_path_factory.mktemp("media"))


@pytest.fixture(scope="module", params=FAMILIES)
def proc(request, tmp_path_factory, media):
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    if family == "qwen2_5_vl":
        path, cfg = build_model_dir(root, verbatim=True), tiny_qwen2_5_vl_config()
    else:
        path = build_tile_model_dir(root, family, verbatim=True)
        cfg = ADAPTERS[family].tiny_config()
    return ConversationProcessor(
        tokenizer=AutoTokenizer.from_pretrained(path, local_files_only=True),
        image_processor=AutoImageProcessor.from_pretrained(path, local_files_only=True),
        config=cfg,
        media_root=media,
    )


def by_hand(family: str, name: str) -> dict:
    """The messages record a user of ``family`` writes for ``RECORDS[name]``."""
    user, answer = BY_HAND[family][name]
    record = RECORDS[name]
    images = record.get("images", [record.get("image")])
    it = iter(images)
    user = [{"type": "image", "image": next(it)} if p is IMG else p for p in user]
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": [text(answer)]}]
    return {"id": name, "messages": msgs}


@pytest.mark.parametrize("name", list(RECORDS))
def test_llava_text_reaches_the_template_as_the_family_writes_it(proc, media, name):
    family = proc.config.model_type
    record = {"id": name, **RECORDS[name]}
    hand = by_hand(family, name)
    hand_messages, _ = to_messages(hand, family)
    rendered, _ = proc.render(to_messages(record, family)[0])
    assert rendered == proc.tokenizer.apply_chat_template(hand_messages, tokenize=False)
    if (family, name) in USER_TURN:
        assert USER_TURN[family, name] in rendered

    ours, theirs = proc(record), proc(hand)
    np.testing.assert_array_equal(ours["input_ids"], theirs["input_ids"])
    np.testing.assert_array_equal(ours["labels"], theirs["labels"])
    if family == "qwen2_5_vl":
        paths = [p["image"] for p in hand["messages"][0]["content"] if "image" in p]
        assert ours["input_ids"].tolist() == qwen_oracle(proc, hand_messages, paths, media)

    label = proc.tokenizer.convert_ids_to_tokens(ours["labels"][ours["labels"] >= 0].tolist())
    end = "<end_of_turn>" if family == "gemma3" else "<|im_end|>"
    answer = RECORDS[name]["conversations"][1]["value"]
    kept = answer.strip() if family == "gemma3" else answer
    assert label == [t for t in kept.replace(" ", "\0 \0").split("\0") if t] + [end]


def test_whitespace_changes_the_ids_except_where_the_template_trims(proc):
    """The old rule (each text piece stripped) renders differently, so the tokenizer would
    catch it; only Gemma 3's own template trims, so its ids are the same either way."""
    family = proc.config.model_type
    record = {"id": "spaces", **RECORDS["spaces"]}
    messages, _ = to_messages(record, family)
    stripped = [
        {
            **m,
            "content": [
                p | {"text": p["text"].strip()} if "text" in p else p for p in m["content"]
            ],
        }
        for m in messages
    ]
    same = proc.render(messages)[0] == proc.render(stripped)[0]
    assert same == (family == "gemma3")
