"""Tier 1: the deprecated LLaVA loader is a thin wrapper over ConversationProcessor (the
tokenizer's chat template), with real image files and a locally built tokenizer."""

import json

import numpy as np
import pytest
import torch

from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
from ray_disagg.data.llava import load_llava
from ray_disagg.models import get_adapter
from ray_disagg.recipes.data import parse_data
from ray_disagg.recipes.schema import RecipeError
from ray_disagg.testing.reference import reference_batch
from tests.conversation_data import RECORDS, build_media, build_model_dir, make_processor


def test_load_llava_wraps_the_conversation_processor(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    media, model = build_media(tmp_path), build_model_dir(tmp_path / "model")
    proc = make_processor(model, media, cfg)
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    kwargs = {"image_root": media, "tokenizer": proc.tokenizer, "config": cfg}
    kwargs["image_processor"] = proc.image_processor
    with pytest.warns(DeprecationWarning, match="conversations_dataset"):
        ds = load_llava(tmp_path / "train.jsonl", **kwargs)
    assert len(ds) == 3
    for i, record in enumerate(RECORDS):
        want = proc(record)
        assert ds[i]["input_ids"] == want["input_ids"].tolist()
        assert ds[i]["labels"] == want["labels"].tolist()
        get_adapter(cfg).validate_sample(ds[i])
    # the samples feed the real HF model
    model = HFModelSpec(config=cfg).build_full()
    loss = model(**reference_batch(HFModelSpec(config=cfg), [ds[i] for i in range(3)])).loss
    assert torch.isfinite(loss)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="chat template"):
        load_llava(tmp_path / "train.jsonl", **kwargs, user_turn=("user:", ""))
    # the recipe type llava: an alias of conversations; the turn prefixes are refused
    d = parse_data({"type": "llava", "annotations": "a.jsonl", "image_root": "i"}, "data.train")
    assert (d["type"], d["records"], d["media_root"]) == ("conversations", "a.jsonl", "i")
    with pytest.raises(RecipeError, match="user_turn: gone"):
        parse_data({"type": "llava", "annotations": "a", "user_turn": ["u", ""]}, "data.train")
    assert np.asarray(ds[0]["image_grid_thw"]).tolist()[0] == [1, 4, 4]
