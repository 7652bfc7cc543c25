"""Tier 1: the LLaVA-style loader with real image files and a locally built tokenizer."""

import json

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
from ray_disagg.data.llava import load_llava
from ray_disagg.models import get_adapter
from ray_disagg.testing.reference import reference_batch

WORDS = ["[UNK]", "user:", "assistant:", "which", "digit", "is", "this", "?", "a", "seven", "hi"]


def _tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_llava_jsonl_to_samples(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    (tmp_path / "img").mkdir()
    sizes = {"a.png": (16, 16), "b.png": (48, 40)}
    for name, (w, h) in sizes.items():
        Image.fromarray((np.random.rand(h, w, 3) * 255).astype(np.uint8)).save(
            tmp_path / "img" / name
        )
    records = [
        {
            "id": "a",
            "image": "a.png",
            "conversations": [
                {"from": "human", "value": "<image>\nwhich digit is this ?"},
                {"from": "gpt", "value": "a seven"},
            ],
        },
        {
            "id": "b",
            "image": "b.png",
            "conversations": [
                {"from": "human", "value": "which digit <image> is this ?"},
                {"from": "gpt", "value": "seven"},
            ],
        },
        {
            "id": "t",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hi"}],
        },
    ]
    ann = tmp_path / "train.jsonl"
    ann.write_text("\n".join(json.dumps(r) for r in records))
    proc = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    ds = load_llava(
        ann, image_root=tmp_path / "img", tokenizer=_tokenizer(), image_processor=proc, config=cfg
    )

    assert len(ds) == 3
    a, b, t = ds[0], ds[1], ds[2]
    assert a["image_grid_thw"] == [[1, 4, 4]]  # 16x16 px, within [min, max] pixels
    ((_, gh, gw),) = b["image_grid_thw"]
    assert gh * gw * 4 * 4 <= 32 * 32 < 48 * 40  # 48x40 px resized down to max_pixels
    for s in (a, b, t):
        get_adapter(cfg).validate_sample(s)
    ids, labels = np.asarray(a["input_ids"]), np.asarray(a["labels"])
    assert (ids == cfg.image_token_id).sum() == 4
    # labels only on the assistant turn ("a seven"), not on "assistant:" or the user turn
    assert [WORDS[i] for i in labels[labels != -100]] == ["a", "seven"]
    assert t["pixel_values"] is None and t["image_grid_thw"] is None

    # the samples feed the real HF model
    model = HFModelSpec(config=cfg).build_full()
    loss = model(**reference_batch(HFModelSpec(config=cfg), [ds[i] for i in range(3)])).loss
    assert torch.isfinite(loss)
