"""Tier 1: videos of the tile families through the conversation data path, with a real mp4
written here and a local tokenizer with the family's chat template: InternVL's and
LLaVA-OneVision's samples have the token ids and pixels of the family's own processor
(``InternVLProcessor`` / ``LlavaOnevisionProcessor``) on the frames its video processor
samples, given to it by a stand-in video processor (HF's needs torchvision); Gemma 3,
which has no video input, refuses videos naming the record or sample."""

from unittest import mock

import numpy as np
import pytest
import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    InternVLProcessor,
    LlavaOnevisionProcessor,
)
from transformers import processing_utils as hf_processing
from transformers.image_processing_utils import BatchFeature
from transformers.image_transforms import normalize, rescale, resize
from transformers.image_utils import ChannelDimension, PILImageResampling
from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

from ray_disagg import ADAPTERS, HFModelSpec
from ray_disagg.data.conversations import ConversationProcessor, to_messages
from ray_disagg.models.base import SampleError
from ray_disagg.testing.conversations import build_tile_model_dir
from tests.conversation_data import build_media
from tests.unit.test_conversations import _write_video

FIRST = ChannelDimension.FIRST
RECORD = {  # a video, then an image, in one user turn
    "id": "clip",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": "v.mp4"},
                {"type": "image", "image": "b.jpg"},
                {"type": "text", "text": "which digit is this?"},
            ],
        },
        {"role": "assistant", "content": "seven."},
    ],
}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """b.jpg (48x40) and v.mp4: 8 frames of 40x48 at 4 fps (2 s)."""
    root = build_media(tmp_path_factory.mktemp("media"))
    rng = np.random.default_rng(5)
    _write_video(root / "v.mp4", (rng.random((8, 40, 48, 3)) * 255).astype(np.uint8), fps=4)
    return root


def _processor(tmp_path, model_type, media) -> ConversationProcessor:
    path = build_tile_model_dir(tmp_path / model_type, model_type)
    return ConversationProcessor(
        tokenizer=AutoTokenizer.from_pretrained(path, local_files_only=True),
        image_processor=AutoImageProcessor.from_pretrained(path, local_files_only=True),
        config=ADAPTERS[model_type].tiny_config(),
        media_root=media,
        fps=2.0,
    )


def _hf_processor(cls, proc, **kwargs):
    """The family's processor with a stand-in video processor that makes each given frame
    a 16x16 tile (bicubic, rescaled, normalized with the image processor's mean and std:
    the family's video processor's steps, without torchvision). transformers resolves the
    video processor's base class only where torchvision loads: given here for the check."""
    ip = proc.image_processor

    def tile(frame):
        x = resize(frame.transpose(2, 0, 1), (16, 16), resample=PILImageResampling.BICUBIC,
                   input_data_format=FIRST)  # fmt: skip
        x = rescale(x.astype(np.float32), 1 / 255, input_data_format=FIRST)
        return normalize(x, ip.image_mean, ip.image_std, input_data_format=FIRST)

    class Frames(BaseVideoProcessor):
        def __call__(self, videos, **_):
            tiles = np.asarray([[tile(f) for f in v] for v in videos], dtype=np.float32)
            return BatchFeature({"pixel_values_videos": torch.from_numpy(tiles)})

    module = hf_processing.transformers_module
    with mock.patch.object(module, "VideoProcessorMixin", VideoProcessorMixin, create=True):
        return cls(image_processor=ip, tokenizer=proc.tokenizer, video_processor=Frames(), **kwargs)


def _oracle(hf, proc, media, frames: list[int]):
    """The family processor's output on the record's text, image and the video's frames
    ``frames`` (indices into every decoded frame)."""
    import av
    from PIL import Image

    messages, _ = to_messages(RECORD, proc.config.model_type)
    text, _ = proc.render(messages)
    with av.open(str(media / "v.mp4")) as c:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    image = Image.open(media / "b.jpg").convert("RGB")
    return hf(text=text, images=[image], videos=[decoded[frames]], return_tensors="pt")


def _check_sample(proc, sample, enc):
    spec = HFModelSpec(config=proc.config, seed=0)
    spec.adapter.validate_sample(sample)
    np.testing.assert_array_equal(sample["input_ids"], enc["input_ids"][0].numpy())
    labels = sample["labels"]
    words = proc.tokenizer.convert_ids_to_tokens(labels[labels >= 0].tolist())
    assert words == ["seven.", "<|im_end|>"]
    loss = spec.build_full()(**spec.adapter.reference_inputs([sample])).loss
    assert torch.isfinite(loss)


def test_internvl_video_frames_are_tiles_with_a_run_each(tmp_path, media):
    """8 frames at 4 fps sampled at 2 fps: 4 frames from InternVL's half-step shift
    (1, 3, 5, 7); each a tile with its own ``Frame{i}: <img>...</img>`` run, the frames
    before the image's tiles in ``pixel_values`` as in the text."""
    proc = _processor(tmp_path, "internvl", media)
    sample = proc(RECORD)
    hf = _hf_processor(InternVLProcessor, proc, image_seq_length=4)
    enc = _oracle(hf, proc, media, [1, 3, 5, 7])
    _check_sample(proc, sample, enc)
    np.testing.assert_allclose(sample["pixel_values"], enc["pixel_values"].numpy(), atol=1e-6)
    assert proc.tokenizer.decode(sample["input_ids"]).count("<img>") == 4 + 1
    assert set(sample) == {"id", "input_ids", "labels", "pixel_values"}  # no video input


def test_llava_onevision_video_is_pooled_rows_and_a_newline(tmp_path, media):
    """4 frames from frame 0 (0, 2, 4, 6), 4 pooled rows each and one newline row as
    ``<video>`` tokens; the image alone among the record's images keeps its crops."""
    proc = _processor(tmp_path, "llava_onevision", media)
    sample = proc(RECORD)
    hf = _hf_processor(
        LlavaOnevisionProcessor, proc, num_image_tokens=16, vision_feature_select_strategy="full"
    )
    enc = _oracle(hf, proc, media, [0, 2, 4, 6])
    _check_sample(proc, sample, enc)
    assert (sample["input_ids"] == 101).sum() == 4 * 4 + 1
    assert sample["video_frames"].tolist() == [4]
    np.testing.assert_allclose(sample["pixel_values_videos"], enc["pixel_values_videos"][0])
    tiles = len(sample["pixel_values"])
    assert tiles > 1  # crops and the base tile
    np.testing.assert_allclose(sample["pixel_values"], enc["pixel_values"][0, :tiles])
    np.testing.assert_array_equal(sample["image_sizes"], enc["image_sizes"].numpy())


def test_videos_are_refused_where_the_family_has_no_video_input(tmp_path, media):
    proc = _processor(tmp_path, "gemma3", media)
    with pytest.raises(ValueError, match=r"record 'clip' has a video but gemma3 has no video"):
        proc(RECORD)
    gemma3 = ADAPTERS["gemma3"](ADAPTERS["gemma3"].tiny_config())
    with pytest.raises(ValueError, match=r"gemma3 samples have no \['videos'\] \(it takes images"):
        gemma3.synthetic_inputs({"videos": [(2, 4, 4)]}, np.random.default_rng(0))
    sample = {"id": "v", "input_ids": np.arange(2), "pixel_values_videos": np.zeros((2, 3, 16, 16))}
    with pytest.raises(SampleError, match=r"sample 'v' has 'pixel_values_videos' but gemma3 has"):
        gemma3.validate_sample(sample)
    internvl = ADAPTERS["internvl"](ADAPTERS["internvl"].tiny_config())
    with pytest.raises(SampleError, match=r"internvl has no separate video input: put each"):
        internvl.validate_sample(sample)
    onevision = ADAPTERS["llava_onevision"](ADAPTERS["llava_onevision"].tiny_config())
    with pytest.raises(SampleError, match=r"sample 'v': a 4-D 'pixel_values_videos' needs"):
        onevision.validate_sample(sample)
    with pytest.raises(SampleError, match=r"0 video tokens \(id 101\) in input_ids but its"):
        onevision.validate_sample(dict(sample, video_frames=[1, 1]))
    crop = _processor(tmp_path, "llava_onevision", media)
    crop.video_processor = {"size": {"shortest_edge": 16}}  # not one tile's size
    with pytest.raises(ValueError, match=r"record 'clip': .*video_processor size=\{'shortest"):
        crop(RECORD)
