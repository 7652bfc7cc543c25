"""Tier 1: conversations for the LLaVA-shaped families (Gemma 3, InternVL,
LLaVA-OneVision) through a local tokenizer with a chat template of the family's shape and
the family's PIL image processor (loaded by ``AutoImageProcessor``, no torchvision): the
samples validate, the HF model takes them (its own placeholder checks), the labels are the
assistant turns only, and for Gemma 3 the tokens are those of HF's own ``Gemma3Processor``."""

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from ray_disagg import ADAPTERS, HFModelSpec
from ray_disagg.data.conversations import ConversationProcessor, to_messages
from ray_disagg.testing.conversations import build_tile_model_dir
from tests.conversation_data import RECORDS, build_media

FAMILIES = ["gemma3", "internvl", "llava_onevision"]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return build_media(tmp_path_factory.mktemp("media"))


def processor(tmp_path, model_type, media):
    path = build_tile_model_dir(tmp_path / model_type, model_type)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    images = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    assert "Pil" in type(images).__name__
    cfg = ADAPTERS[model_type].tiny_config()
    return ConversationProcessor(
        tokenizer=tok, image_processor=images, config=cfg, media_root=media
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_conversations_become_samples_the_hf_model_takes(tmp_path, media, model_type):
    proc = processor(tmp_path, model_type, media)
    spec = HFModelSpec(config=proc.config, seed=0)
    samples = [proc(r) for r in RECORDS]
    for i, s in enumerate(samples):
        spec.adapter.validate_sample(s, i)
    llava, one, text = samples
    assert "pixel_values" not in text
    assert spec.adapter.tiles(llava) >= 2 and spec.adapter.tiles(one) >= 1
    if model_type != "gemma3":  # an image alone in its sample has crops / tiles
        assert spec.adapter.tiles(one) > 1
    words = proc.tokenizer.convert_ids_to_tokens(llava["labels"][llava["labels"] >= 0].tolist())
    end = "<end_of_turn>" if model_type == "gemma3" else "<|im_end|>"
    assert words == ["seven.", end, "two.", end]
    loss = spec.build_full()(**spec.adapter.reference_inputs(samples)).loss
    assert torch.isfinite(loss)


def test_gemma3_tokens_are_the_hf_processors(tmp_path, media):
    from PIL import Image
    from transformers import Gemma3Processor

    proc = processor(tmp_path, "gemma3", media)
    hf = Gemma3Processor(
        image_processor=proc.image_processor, tokenizer=proc.tokenizer, image_seq_length=4
    )
    for record in RECORDS[:2]:
        messages, files = to_messages(record)
        text, _ = proc.render(messages)
        images = [Image.open(media / f).convert("RGB") for _, f in files]
        enc = hf(text=text, images=images, return_tensors="np")
        ours = proc(record)
        np.testing.assert_array_equal(ours["input_ids"], enc["input_ids"][0])
        np.testing.assert_array_equal(ours["pixel_values"], enc["pixel_values"])
