"""The conversation-stream tests' records: a JSON Lines file of LLaVA conversations
(``r0``..``r8``, a broken record among them, a blank line) over a media folder, shared
by the gloo tier (``tests/gloo/test_conversation_stream.py``) and the Ray tier
(``tests/ray/test_conversation_stream.py``)."""

import json

from ray_disagg import tiny_qwen2_5_vl_config
from tests.conversation_data import build_media, build_model_dir, make_processor

QUESTIONS = ["which digit is this?", "and now?"]
ANSWERS = ["seven.", "two."]
IMAGES = [None, "a.png", "b.jpg"]


def record(i: int, image: str | None = "auto") -> dict:
    """Record ``r<i>``: a LLaVA conversation with 0 or 1 image (by ``i``)."""
    image = IMAGES[i % 3] if image == "auto" else image
    q = ("<image>\n" if image else "") + QUESTIONS[i % 2]
    conv = [{"from": "human", "value": q}, {"from": "gpt", "value": ANSWERS[i // 2 % 2]}]
    return {"id": f"r{i}", **({"image": image} if image else {}), "conversations": conv}


BROKEN = {**record(0, image="missing.png"), "id": "broken"}


def stream_data(root):
    """``(processor, JSON Lines file of r0..r8 with a broken record 4th, config)`` under
    ``root``."""
    media = build_media(root)
    model = build_model_dir(root / "model")
    records = [record(i) for i in range(9)]
    records.insert(3, BROKEN)
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "")  # blank lines are not records
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    cfg = tiny_qwen2_5_vl_config()
    return make_processor(model, media, cfg), root / "train.jsonl", cfg


STREAM_LOOP = {"global_batch_size": 2, "checkpoint_every": 1, "report_sample_ids": True, "seed": 7}


def step_ids(result) -> list[list[str]]:
    rows = result.metrics_dataframe.sort_values("step")
    return [list(ids) for ids in rows["sample_ids"]]
