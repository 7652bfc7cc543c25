"""Tier 1: Qwen2.5-Omni conversations with audio, an image and a video, through a local
model directory (Omni's chat template, the PIL image processor, a WhisperFeatureExtractor)
and real files written here (a 16 kHz WAV, an 8 kHz WAV that is resampled, a PNG, an
mp4). Oracle: the feature extractor's own features of the waveform (the WAV read with the
standard library), one ``<|AUDIO|>`` per audio-tower output
(``_get_feat_extract_output_lengths``), the template tokenized by ``apply_chat_template``;
the sample feeds the real HF thinker."""

import wave

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ray_disagg import HFModelSpec, tiny_qwen2_5_omni_thinker_config, tiny_qwen2_5_vl_config
from ray_disagg.data.conversations import ConversationProcessor, to_messages
from ray_disagg.models import get_adapter
from ray_disagg.testing.conversations import OMNI_SPECIAL, build_omni_model_dir
from ray_disagg.testing.reference import reference_batch
from tests.unit.test_conversations import _write_video


def _write_wav(path, seconds: float, rate: int, seed: int) -> np.ndarray:
    """A 16-bit mono WAV; returns its samples as float32 in [-1, 1)."""
    rng = np.random.default_rng(seed)
    pcm = (rng.uniform(-0.5, 0.5, int(seconds * rate)) * 32768).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni")
    model = build_omni_model_dir(root / "model")
    rng = np.random.default_rng(2)
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype(np.uint8)).save(root / "a.png")
    waves = {"a.wav": _write_wav(root / "a.wav", 1.0, 16000, 0)}
    _write_wav(root / "b.wav", 0.5, 8000, 1)  # resampled to 16 kHz when decoded
    frames = (rng.random((4, 16, 16, 3)) * 255).astype(np.uint8)
    _write_video(root / "v.mp4", frames, fps=2)
    cfg = tiny_qwen2_5_omni_thinker_config()
    proc = ConversationProcessor(
        tokenizer=AutoTokenizer.from_pretrained(model, local_files_only=True),
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model, local_files_only=True),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model / "audio"),
        config=cfg,
        media_root=root,
    )
    return proc, cfg, waves


RECORD = {
    "id": "omni",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "audio", "audio": "a.wav"},
                {"type": "image", "image": "a.png"},
                {"type": "text", "text": "which digit is this?"},
            ],
        },
        {"role": "assistant", "content": "seven."},
        {
            "role": "user",
            "content": [
                {"type": "video", "video": "v.mp4"},
                {"type": "audio", "audio": "b.wav"},
                {"type": "text", "text": "and now?"},
            ],
        },
        {"role": "assistant", "content": "two."},
    ],
}


def test_audio_image_and_video_become_an_omni_sample(omni):
    proc, cfg, waves = omni
    sample = proc(RECORD)
    get_adapter(cfg).validate_sample(sample)
    # the extractor's own features of the WAV, masked frames equal
    fe = proc.feature_extractor
    own = fe(waves["a.wav"], sampling_rate=16000, padding="max_length",
             return_attention_mask=True, return_tensors="np")  # fmt: skip
    mask = sample["feature_attention_mask"]
    assert mask[0].sum() == own["attention_mask"].sum() == 100  # 1 s of 10 ms frames
    assert mask[1].sum() == 50  # 0.5 s at 8 kHz, resampled: still 0.5 s
    np.testing.assert_allclose(
        sample["input_features"][0][:, :100], own["input_features"][0][:, :100], atol=1e-5
    )
    # token counts: the HF audio encoder's own output lengths; text: the template's
    hf_len = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths
    counts = [int(hf_len(None, torch.tensor(int(m.sum())))[1]) for m in mask]
    ids = sample["input_ids"]
    assert (ids == OMNI_SPECIAL["<|AUDIO|>"]).sum() == sum(counts) == 25 + 12
    messages, _ = to_messages(RECORD)
    template = proc.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    pads = {OMNI_SPECIAL[t] for t in ("<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>")}
    collapsed = [t for k, t in enumerate(ids.tolist()) if t not in pads or ids[k - 1] != t]
    assert collapsed == template
    assert sample["video_second_per_grid"].tolist() == [1.0]  # 2 frames per group at 2 fps
    # the real HF thinker takes it
    spec = HFModelSpec(config=cfg)
    loss = spec.build_full()(**reference_batch(spec, [sample])).loss
    assert torch.isfinite(loss)


def test_audio_needs_a_family_with_an_audio_tower_and_an_extractor(omni):
    proc, _, _ = omni
    vl = ConversationProcessor(
        tokenizer=proc.tokenizer,
        image_processor=proc.image_processor,
        feature_extractor=proc.feature_extractor,
        config=tiny_qwen2_5_vl_config(),
        media_root=proc.media_root,
    )
    with pytest.raises(ValueError, match="audio needs a family with an audio tower"):
        vl(RECORD)
    proc_without = ConversationProcessor(
        tokenizer=proc.tokenizer,
        image_processor=proc.image_processor,
        config=proc.config,
        media_root=proc.media_root,
    )
    with pytest.raises(ValueError, match=r"feature_extractor=\.\.\."):
        proc_without(RECORD)
    llava = {"id": "l", "audio": "missing.wav", "conversations": [
        {"from": "human", "value": "<audio> which digit is this?"},
        {"from": "gpt", "value": "seven."}]}  # fmt: skip
    with pytest.raises(ValueError, match=r"record 'l': cannot read audio"):
        proc(llava)
